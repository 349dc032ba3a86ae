"""Exceptions raised by quant_torch_fx for invalid user input.

Both derive from ValueError so callers that only know "bad input" can catch one type.

Example:
    >>> try:
    ...     raise DataError("calibration data: batch 0 has shape [2, 5]; expected [N, 3, 8, 8]")
    ... except ValueError as exc:
    ...     print(exc)
    calibration data: batch 0 has shape [2, 5]; expected [N, 3, 8, 8]
"""

from __future__ import annotations


class CaptureError(ValueError):
    """``torch.export`` cannot capture the model: the message names the construct, where
    it is, and how to leave it out.

    Example:
        >>> isinstance(CaptureError("model: cannot capture"), ValueError)
        True
    """


class DataError(ValueError):
    """Calibration or training data does not fit the model (names the batch and shape).

    Example:
        >>> str(DataError("calibration data: no batches"))
        'calibration data: no batches'
    """
