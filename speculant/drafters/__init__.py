from .base import EMPTY, Draft, Drafter
from .composite import CompositeDrafter
from .history import HistoryDrafter
from .lookup import LookupDrafter
from .model import ModelDrafter
from .prediction import PredictionDrafter

__all__ = ["Draft", "Drafter", "EMPTY", "ModelDrafter", "LookupDrafter", "CompositeDrafter", "HistoryDrafter",
           "PredictionDrafter"]
