"""manage.py seed_demo: the demo shop's products and a year of orders, for the sales report."""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from reports.demo import DEFAULT_DAYS, DEFAULT_SEED, demo_seed


class Command(BaseCommand):
    help = (
        "Seed the demo shop (products, orders, order lines) that the sales report reads. "
        "Does nothing while the data is current; --reset seeds again."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--seed", type=int, default=DEFAULT_SEED, help="Random seed (same seed, same data)."
        )
        parser.add_argument(
            "--days", type=int, default=DEFAULT_DAYS, help="Days of orders, ending today."
        )
        parser.add_argument(
            "--reset", action="store_true", help="Delete the demo data and seed it again."
        )

    def handle(self, *args: Any, seed: int, days: int, reset: bool, **options: Any) -> None:
        started = time.monotonic()
        result = demo_seed(seed=seed, days=days, reset=reset)
        verb = "Seeded" if result.created else "Demo data is current; kept"
        self.stdout.write(
            f"{verb} {result.products} products, {result.orders} orders, "
            f"{result.lines} order lines "
            f"({time.monotonic() - started:.2f}s)."
        )
