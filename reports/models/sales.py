"""Demo shop data for the sales report: products, orders and their lines (see `seed_demo`)."""

from __future__ import annotations

from django.db import models


class Product(models.Model):
    """Something the demo shop sells."""

    sku = models.CharField("SKU", max_length=32, unique=True, help_text="Stock keeping unit code.")
    name = models.CharField("name", max_length=120, help_text="Name shown on orders and reports.")
    category = models.CharField(
        "category", max_length=60, help_text="Product family the sales report groups by."
    )
    unit_price = models.DecimalField(
        "list price", max_digits=10, decimal_places=2, help_text="Current price per unit (USD)."
    )
    active = models.BooleanField("active", default=True, help_text="Still on sale.")

    class Meta:
        verbose_name = "product"
        verbose_name_plural = "products"
        ordering = ("category", "name")
        indexes = [models.Index(fields=["category"], name="product_category_idx")]

    def __str__(self) -> str:
        return f"{self.name} ({self.sku})"


class SalesRegion(models.TextChoices):
    """Where an order ships to."""

    NORTHEAST = "northeast", "Northeast"
    SOUTHEAST = "southeast", "Southeast"
    MIDWEST = "midwest", "Midwest"
    SOUTHWEST = "southwest", "Southwest"
    WEST = "west", "West"


class SalesChannel(models.TextChoices):
    """Where an order was placed."""

    WEB = "web", "Web shop"
    STORE = "store", "Store"
    PARTNER = "partner", "Partner"


class OrderStatus(models.TextChoices):
    """Whether an order's revenue counts."""

    PAID = "paid", "Paid"  # counts as revenue
    REFUNDED = "refunded", "Refunded"  # paid, then refunded in full: counted as refunds only


class OrderQuerySet(models.QuerySet["Order"]):
    def placed_between(self, start: object, end: object) -> OrderQuerySet:
        """Orders placed in [start, end)."""
        return self.filter(placed_at__gte=start, placed_at__lt=end)

    def paid(self) -> OrderQuerySet:
        return self.filter(status=OrderStatus.PAID)


class Order(models.Model):
    """One customer order."""

    number = models.CharField(
        "number", max_length=20, unique=True, help_text="Order number, e.g. SO-000123."
    )
    placed_at = models.DateTimeField("placed", help_text="When the customer placed the order.")
    region = models.CharField(
        "region", max_length=16, choices=SalesRegion.choices, help_text="Shipping region."
    )
    channel = models.CharField(
        "channel", max_length=16, choices=SalesChannel.choices, help_text="Where it was placed."
    )
    status = models.CharField(
        "status",
        max_length=16,
        choices=OrderStatus.choices,
        default=OrderStatus.PAID,
        help_text="Paid or refunded.",
    )

    objects = OrderQuerySet.as_manager()

    class Meta:
        verbose_name = "order"
        verbose_name_plural = "orders"
        ordering = ("-placed_at",)
        indexes = [models.Index(fields=["placed_at", "status"], name="order_placed_idx")]

    def __str__(self) -> str:
        return self.number


class OrderLine(models.Model):
    """A product and quantity on an order, at the price charged."""

    order = models.ForeignKey(
        Order,
        on_delete=models.CASCADE,
        related_name="lines",
        verbose_name="order",
        help_text="The order this line belongs to.",
    )
    product = models.ForeignKey(
        Product,
        on_delete=models.PROTECT,
        related_name="order_lines",
        verbose_name="product",
        help_text="What was sold.",
    )
    quantity = models.PositiveIntegerField("quantity", help_text="Units sold.")
    unit_price = models.DecimalField(
        "unit price",
        max_digits=10,
        decimal_places=2,
        help_text="Price charged per unit (USD), after any discount.",
    )

    class Meta:
        verbose_name = "order line"
        verbose_name_plural = "order lines"

    def __str__(self) -> str:
        return f"{self.quantity} x {self.product_id} on {self.order_id}"

    @property
    def amount(self) -> object:
        return self.quantity * self.unit_price
