// Panier d'achat côté client : articles, remises et total.

const TAX_RATE = 0.2;

class Cart {
  constructor() {
    // liste des lignes { id, name, unitPrice, qty }
    this.lines = [];
  }

  addLine(id, name, unitPrice, qty = 1) {
    // si l'article existe déjà, on augmente seulement la quantité
    const existing = this.lines.find((l) => l.id === id);
    if (existing) {
      existing.qty += qty;
      return existing;
    }
    const line = { id, name, unitPrice, qty };
    this.lines.push(line);
    return line;
  }

  removeLine(id) {
    this.lines = this.lines.filter((l) => l.id !== id);
  }

  subtotal() {
    // somme des prix unitaires multipliés par les quantités
    return this.lines.reduce((sum, l) => sum + l.unitPrice * l.qty, 0);
  }

  discount(code) {
    // codes connus : PROMO10 (10 %), PROMO25 (25 % dès 100 euros d'achat)
    const sub = this.subtotal();
    if (code === "PROMO10") return sub * 0.1;
    if (code === "PROMO25" && sub > 100) return sub * 0.25;
    return 0;
  }

  total(code) {
    const net = this.subtotal() - this.discount(code);
    // la TVA s'applique après la remise
    return Math.round(net * (1 + TAX_RATE) * 100) / 100;
  }
}

function formatPrice(value) {
  // deux décimales et le symbole euro
  return value.toFixed(2) + " €";
}

module.exports = { Cart, formatPrice, TAX_RATE };
