"""An exponential moving average of the weights (Polyak averaging, as Marian's
--exponential-smoothing and fairseq's --store-ema): kept beside the training weights, in
float32, moved towards them after every update; validated, kept as the best model and
translated with in their place."""

from __future__ import annotations

import torch


class Average:
    """The moving average of `model`'s weights with `decay`. Early on the decay is lower,
    min(decay, (1 + step) / (10 + step)), so the average does not hold on to the initial weights
    for thousands of updates (TensorFlow's ExponentialMovingAverage with num_updates)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        # Views of the model's weights, taken once: the optimizer and load_state_dict write into
        # them in place, so no update has to build a state_dict.
        self._model_weights = list(model.state_dict().values())
        self.weights = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
        self._own = list(self.weights.values())

    def update(self, step: int) -> None:
        """After update `step` (from 1): a step towards the model's weights, on the device."""
        decay = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self._own, [v.float() for v in self._model_weights], 1 - decay)

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        for k, v in weights.items():
            self.weights[k].copy_(v)

    def swapped_into(self, model: torch.nn.Module):
        """A context in which `model` holds the average (its own weights put back after)."""
        import contextlib

        @contextlib.contextmanager
        def swap():
            own = {k: v.detach().clone() for k, v in model.state_dict().items()}
            model.load_state_dict(self.weights)
            try:
                yield
            finally:
                model.load_state_dict(own)

        return swap()
