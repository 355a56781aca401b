from .base import EMPTY, Draft, Drafter
from .model import ModelDrafter

__all__ = ["Draft", "Drafter", "EMPTY", "ModelDrafter"]
