"""A small stock-keeping module for a shop's back office."""

from dataclasses import dataclass, field


@dataclass
class Item:
    sku: str
    name: str
    price_cents: int
    quantity: int = 0


@dataclass
class Inventory:
    items: dict = field(default_factory=dict)

    def add_item(self, sku, name, price_cents, quantity=0):
        if sku in self.items:
            raise ValueError(f"duplicate sku {sku}")
        self.items[sku] = Item(sku, name, price_cents, quantity)

    def restock(self, sku, amount):
        if amount <= 0:
            raise ValueError("amount must be positive")
        self.items[sku].quantity += amount

    def sell(self, sku, amount):
        item = self.items[sku]
        if amount > item.quantity:
            raise ValueError(f"only {item.quantity} of {sku} left")
        item.quantity -= amount
        return item.price_cents * amount

    def total_value(self):
        total = 0
        for item in self.items.values():
            total += item.price_cents
        return total

    def low_stock(self, threshold=5):
        return sorted(sku for sku, item in self.items.items() if item.quantity < threshold)

    def find_by_name(self, text):
        text = text.lower()
        return [item for item in self.items.values() if text in item.name.lower()]


def format_cents(cents):
    return f"{cents // 100}.{cents % 100:02d}"


if __name__ == "__main__":
    inv = Inventory()
    inv.add_item("A1", "Blue mug", 850, 12)
    inv.add_item("B2", "Tea towel", 499, 3)
    inv.sell("A1", 2)
    print(format_cents(inv.total_value()), inv.low_stock())
