"""Errors a user can act on. The CLI prints their message on one line and exits non-zero."""


class SpeculantError(Exception):
    """Base class: anything caused by the user's input or environment, not by a bug."""


class ModelError(SpeculantError, ValueError):
    """A model cannot be found, fetched, verified or loaded (a ValueError, as llama-cpp-python's for a bad file)."""


def nonfinite_logits(model) -> ModelError:
    """A model whose pass gave NaN or infinite logits: decoding would read garbage (NaN rows came out as an empty
    answer ended by EOS, with success)."""
    return ModelError(f"{model} computes NaN or infinite logits: its weights are damaged (check the file's sha256, or "
                      f"fetch it again with `speculant pull`), or llama.cpp cannot compute this model")


class VocabMismatchError(SpeculantError):
    """The draft cannot propose tokens for the target: their vocabularies differ."""


class SettingsError(SpeculantError, ValueError):
    """An impossible generation setting (bad k, temperature, top-p, empty prompt, ...)."""


class ContextOverflowError(SpeculantError, ValueError):
    """The prompt does not fit the context window (a ValueError, as llama-cpp-python's)."""


class Cancelled(SpeculantError):
    """The request's work was stopped on the way (a server client that went away during its prompt)."""
