"""The observer protocol: streaming, mergeable statistics of one tensor.

A backend reduces each batch to statistics on its own device and calls ``update``;
``merge`` combines observers fed in different processes; ``state_dict`` /
``from_state_dict`` move them between processes; ``qparams`` turns the statistic
into quantization parameters with ``quant_core``'s one implementation of the math.
Memory never depends on how many batches were seen.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import numpy as np

from quant_core.errors import ConfigError, DataError
from quant_core.qparams import QParams, qparams_from_range
from quant_core.spec import QuantSpec

StateDict = dict[str, Any]


class Observer(abc.ABC):
    """Base class of every observer. Subclasses register under their ``kind`` so that
    :meth:`from_state_dict` can rebuild any of them.

    Example:
        >>> import numpy as np
        >>> from quant_core.observers import make_observer
        >>> from quant_core.spec import QuantSpec
        >>> obs = make_observer(QuantSpec(dtype="int8"))
        >>> obs.update(np.array([-0.5, 1.27]))
        >>> copy = Observer.from_state_dict(obs.state_dict())  # e.g. sent from another process
        >>> copy.qparams() == obs.qparams()
        True
    """

    kind: ClassVar[str]
    _registry: ClassVar[dict[str, type[Observer]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            Observer._registry[cls.kind] = cls

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec

    @abc.abstractmethod
    def update(self, x: np.ndarray) -> None:
        """Fold one batch (any shape) into the statistic."""

    @abc.abstractmethod
    def merge(self, other: Observer) -> None:
        """Fold another observer of the same kind and spec into this one, in place."""

    @abc.abstractmethod
    def range(self, spec: QuantSpec | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The ``(min, max)`` range the statistic selects for ``self.spec`` (or ``spec``,
        see :meth:`qparams`)."""

    @property
    @abc.abstractmethod
    def empty(self) -> bool:
        """True until the first ``update``."""

    def qparams(self, spec: QuantSpec | None = None) -> QParams:
        """Quantization parameters for ``self.spec`` from what was observed, or for
        ``spec``: another format of the same tensor from the same statistic (how mixed
        precision gets a raised layer's 16-bit qparams without calibrating again). ``spec``
        must use the same calibration method and granularity.

        Example:
            >>> import numpy as np
            >>> from quant_core.observers import make_observer
            >>> obs = make_observer(QuantSpec(dtype="uint8", symmetric=False))
            >>> obs.update(np.array([0.0, 2.55], np.float32))
            >>> round(float(obs.qparams().scale), 6), round(float(obs.qparams(obs.spec.evolve(dtype="uint16")).scale), 9)
            (0.01, 3.8911e-05)
        """
        return self.selection(spec)[1]

    def selection(self, spec: QuantSpec | None = None) -> tuple[tuple[np.ndarray, np.ndarray], QParams]:
        """The selected ``(min, max)`` range and the :meth:`qparams` it gives, from one range
        selection (entropy and MSE searches are the slow part of a calibration).

        Example:
            >>> import numpy as np
            >>> from quant_core.observers import make_observer
            >>> obs = make_observer(QuantSpec(dtype="int8"))
            >>> obs.update(np.array([-1.0, 2.54], np.float32))
            >>> (lo, hi), qp = obs.selection()
            >>> float(hi), qp == obs.qparams()
            (2.5399999618530273, True)
        """
        if self.empty:
            raise DataError(f"{type(self).__name__}: no data observed; call update() first")
        target = self.spec if spec is None else spec
        if target.observer != self.spec.observer or target.per_channel_axis != self.spec.per_channel_axis:
            raise ConfigError(
                "spec: another format of an observed tensor must keep its observer and per_channel_axis "
                f"({self.spec.observer!r}, {self.spec.per_channel_axis!r})"
            )
        lo, hi = self.range(target)
        return (lo, hi), qparams_from_range(lo, hi, target)

    def clamped(self, lo: float, hi: float) -> Observer:
        """An observer of the same spec whose statistic is that of this one's values
        clipped to ``[lo, hi]``: what a reader that saturates there sees (this one is not
        changed). The base keeps the statistic as it is; observers that can clip theirs
        override this.

        Example:
            >>> import numpy as np
            >>> from quant_core.observers import make_observer
            >>> obs = make_observer(QuantSpec(dtype="int8"))
            >>> obs.update(np.array([-20.0, 5.0], np.float32))
            >>> [float(v) for v in obs.clamped(-3.0, float("inf")).range()], [float(v) for v in obs.range()]
            ([-3.0, 5.0], [-20.0, 5.0])
        """
        return self

    @abc.abstractmethod
    def _state(self) -> StateDict:
        """Observer-specific state: numpy arrays and plain Python values."""

    @abc.abstractmethod
    def _load_state(self, state: StateDict) -> None:
        """Inverse of :meth:`_state`."""

    def state_dict(self) -> StateDict:
        """Everything needed to rebuild the observer (the spec as JSON-ready data)."""
        from quant_core.serialization import to_data

        return {"kind": self.kind, "spec": to_data(self.spec), **self._state()}

    @staticmethod
    def from_state_dict(state: StateDict) -> Observer:
        """Rebuild an observer of any kind from :meth:`state_dict`'s output."""
        from quant_core.serialization import from_data

        kind = state.get("kind")
        if kind not in Observer._registry:
            raise ConfigError(
                f"kind: {kind!r} is not a known observer; allowed: {', '.join(sorted(Observer._registry))}"
            )
        cls = Observer._registry[kind]
        observer = cls(from_data(QuantSpec, state["spec"]))
        observer._load_state(state)
        return observer

    def _check_mergeable(self, other: Observer) -> None:
        if type(other) is not type(self):
            raise TypeError(f"cannot merge {type(other).__name__} into {type(self).__name__}")
        if other.spec != self.spec:
            raise ConfigError("cannot merge observers built for different specs")
