"""Progress bars leave no stale line above an error, however the work was cut short."""

from __future__ import annotations

import io

import pytest
import tqdm.std

from quant_algos.progress import clear_open_bars, progress_bar


def _screen(text: str) -> list[str]:
    """What a terminal shows: each line's text after its last carriage return."""
    return [line.rsplit("\r", 1)[-1].rstrip() for line in text.split("\n")]


def test_a_bar_cut_off_while_tqdm_draws_it_is_erased(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C right after tqdm's first draw, inside its constructor: the bar is not yet
    handed to anyone, so only clear_open_bars can erase it."""
    drawn = tqdm.std.tqdm.refresh

    def draw_then_interrupt(self: tqdm.std.tqdm, *args: object, **kwargs: object) -> None:
        drawn(self, *args, **kwargs)
        raise KeyboardInterrupt

    out = io.StringIO()
    monkeypatch.setattr(tqdm.std.tqdm, "refresh", draw_then_interrupt)
    try:
        tqdm.std.tqdm(total=3, desc="calibrating", file=out)
    except KeyboardInterrupt:  # as the CLI does: erase the bars, then print the error
        monkeypatch.setattr(tqdm.std.tqdm, "refresh", drawn)
        assert "calibrating" in out.getvalue()
        clear_open_bars()
        out.write("error\n")
    assert _screen(out.getvalue()) == ["error", ""]


def test_a_failed_phase_erases_its_bar_and_a_finished_one_keeps_it(capsys: pytest.CaptureFixture[str]) -> None:
    with progress_bar(total=2, desc="done", unit="batch", quiet=False) as bar:
        bar.update(2)
    with pytest.raises(ValueError), progress_bar(total=2, desc="failed", unit="batch", quiet=False) as bar:
        bar.update(1)
        raise ValueError("bad batch")
    visible = [line for line in _screen(capsys.readouterr().err) if line]
    assert len(visible) == 1 and visible[0].startswith("done: 100%"), visible
