"""Demo shop data for the sales report: a year of orders ending today, the same on every run.

The generator draws from one random.Random(seed), so the same seed gives the same catalogue,
the same number of orders per day and the same lines; only the calendar dates move with today.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, time, timedelta
from decimal import ROUND_HALF_UP, Decimal
from typing import TypeVar

from django.db import transaction
from django.utils import timezone

from .models import Order, OrderLine, OrderStatus, Product, SalesChannel, SalesRegion

DEFAULT_SEED = 20240917
DEFAULT_DAYS = 365
# Data whose newest order is older than this is seeded again, so "the last 30 days" has data.
STALE_AFTER = timedelta(days=7)
ORDER_PREFIX = "SO-"
BATCH = 1000

Choice = TypeVar("Choice")

CATALOGUE: dict[str, list[tuple[str, str]]] = {
    "Audio": [
        ("Studio Headphones", "249.00"),
        ("Wireless Earbuds", "129.00"),
        ("Bookshelf Speakers", "349.00"),
        ("Soundbar", "399.00"),
        ("USB Microphone", "89.00"),
    ],
    "Cameras": [
        ("Mirrorless Camera", "1199.00"),
        ("Action Camera", "329.00"),
        ("Prime Lens 35mm", "549.00"),
        ("Tripod", "119.00"),
        ("Camera Bag", "69.00"),
    ],
    "Computers": [
        ("13-inch Laptop", "999.00"),
        ("Mini PC", "649.00"),
        ("27-inch Monitor", "329.00"),
        ("Mechanical Keyboard", "119.00"),
        ("Wireless Mouse", "49.00"),
    ],
    "Home": [
        ("Smart Thermostat", "199.00"),
        ("Robot Vacuum", "449.00"),
        ("Air Purifier", "229.00"),
        ("Smart Bulb 4-pack", "49.00"),
        ("Video Doorbell", "149.00"),
    ],
    "Kitchen": [
        ("Espresso Machine", "599.00"),
        ("Blender", "129.00"),
        ("Air Fryer", "99.00"),
        ("Chef's Knife", "89.00"),
        ("Cast Iron Skillet", "39.00"),
    ],
    "Outdoor": [
        ("Trail Backpack", "159.00"),
        ("Camping Tent", "289.00"),
        ("Headlamp", "39.00"),
        ("Water Filter", "45.00"),
        ("Sleeping Bag", "179.00"),
    ],
    "Fitness": [
        ("Smart Watch", "299.00"),
        ("Yoga Mat", "35.00"),
        ("Adjustable Dumbbells", "349.00"),
        ("Foam Roller", "29.00"),
        ("Jump Rope", "19.00"),
    ],
    "Office": [
        ("Standing Desk", "549.00"),
        ("Ergonomic Chair", "429.00"),
        ("Desk Lamp", "59.00"),
        ("Notebook Set", "19.00"),
        ("Fountain Pen", "79.00"),
    ],
}
REGION_WEIGHTS = {
    SalesRegion.NORTHEAST: 26,
    SalesRegion.SOUTHEAST: 19,
    SalesRegion.MIDWEST: 17,
    SalesRegion.SOUTHWEST: 14,
    SalesRegion.WEST: 24,
}
CHANNEL_WEIGHTS = {SalesChannel.WEB: 62, SalesChannel.STORE: 27, SalesChannel.PARTNER: 11}
REFUND_RATE = 0.04


@dataclass(frozen=True)
class SeedResult:
    created: bool
    products: int
    orders: int
    lines: int


def _money(value: float) -> Decimal:
    return Decimal(str(value)).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)


def demo_is_current(now: datetime | None = None) -> bool:
    newest = Order.objects.filter(number__startswith=ORDER_PREFIX).order_by("-placed_at").first()
    return newest is not None and (now or timezone.now()) - newest.placed_at < STALE_AFTER


def demo_seed(
    *, seed: int = DEFAULT_SEED, days: int = DEFAULT_DAYS, reset: bool = False
) -> SeedResult:
    """Seed the demo shop unless its data is current (or `reset`); one transaction."""
    if not reset and demo_is_current():
        return SeedResult(
            created=False,
            products=Product.objects.count(),
            orders=Order.objects.count(),
            lines=OrderLine.objects.count(),
        )
    rng = random.Random(seed)
    zone = timezone.get_current_timezone()
    today = timezone.localdate()
    with transaction.atomic():
        Order.objects.filter(number__startswith=ORDER_PREFIX).delete()
        Product.objects.filter(sku__startswith="DEMO-").delete()
        products = _products()
        Product.objects.bulk_create(products, batch_size=BATCH)
        # Some products sell better than others, and cheaper things sell more often.
        popularity = [
            rng.lognormvariate(0, 0.6) * (80 / float(p.unit_price)) ** 0.75 for p in products
        ]

        orders: list[Order] = []
        plans: list[list[tuple[int, int, Decimal]]] = []
        for offset in range(days - 1, -1, -1):
            day = today - timedelta(days=offset)
            growth = 1.0 + 0.35 * (days - offset) / days  # the shop grows over the year
            weekend = 1.3 if day.weekday() >= 5 else 1.0
            season = 1.5 if day.month in (11, 12) else (0.85 if day.month in (1, 2) else 1.0)
            for _ in range(max(1, round(rng.gauss(6.5, 1.8) * growth * weekend * season))):
                minute = rng.randint(8 * 60, 22 * 60 - 1)
                orders.append(
                    Order(
                        number=f"{ORDER_PREFIX}{len(orders) + 1:06d}",
                        placed_at=datetime.combine(day, time(minute // 60, minute % 60), zone),
                        region=_weighted(rng, REGION_WEIGHTS),
                        channel=_weighted(rng, CHANNEL_WEIGHTS),
                        status=OrderStatus.REFUNDED
                        if rng.random() < REFUND_RATE
                        else OrderStatus.PAID,
                    )
                )
                plans.append(_lines(rng, products, popularity))
        Order.objects.bulk_create(orders, batch_size=BATCH)
        lines = [
            OrderLine(order=order, product=products[index], quantity=quantity, unit_price=price)
            for order, plan in zip(orders, plans, strict=True)
            for index, quantity, price in plan
        ]
        OrderLine.objects.bulk_create(lines, batch_size=BATCH)
    return SeedResult(created=True, products=len(products), orders=len(orders), lines=len(lines))


def _products() -> list[Product]:
    return [
        Product(
            sku=f"DEMO-{category[:3].upper()}-{number:03d}",
            name=name,
            category=category,
            unit_price=Decimal(price),
        )
        for category, items in CATALOGUE.items()
        for number, (name, price) in enumerate(items, 1)
    ]


def _lines(
    rng: random.Random, products: list[Product], popularity: list[float]
) -> list[tuple[int, int, Decimal]]:
    count = rng.choices((1, 2, 3, 4), weights=(50, 30, 14, 6))[0]
    chosen: set[int] = set()
    while len(chosen) < count:
        chosen.add(rng.choices(range(len(products)), weights=popularity)[0])
    plan = []
    for index in sorted(chosen):
        price = products[index].unit_price
        if rng.random() < 0.18:  # a promotion: 5-20 % off
            price = _money(float(price) * (1 - rng.choice((0.05, 0.10, 0.15, 0.20))))
        plan.append((index, rng.choices((1, 2, 3), weights=(78, 17, 5))[0], price))
    return plan


def _weighted(rng: random.Random, weights: dict[Choice, int]) -> Choice:
    return rng.choices(list(weights), weights=list(weights.values()))[0]
