from .base import EMPTY, Draft, Drafter
from .composite import CompositeDrafter
from .lookup import LookupDrafter
from .model import ModelDrafter

__all__ = ["Draft", "Drafter", "EMPTY", "ModelDrafter", "LookupDrafter", "CompositeDrafter"]
