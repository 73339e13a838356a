"""The pre-flight memory picture (``report.tensorboard.memory_figure`` / ``memory_picture``), matplotlib."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from resource_guard.estimate import CATEGORIES, estimate_memory
from resource_guard.observe.monitor import RunMonitor
from resource_guard.report.tensorboard import figure_image, memory_figure, memory_picture, png_bytes

CAPACITY_RED = np.array([220, 0, 0])
TIMELINE = [
    ("forward", (100, 0, 0, 50, 0, 10, 0)),
    ("forward", (100, 0, 0, 120, 0, 10, 0)),
    ("backward", (100, 80, 0, 60, 30, 10, 0)),
    ("backward", (100, 100, 0, 20, 30, 10, 0)),
    ("optimizer", (100, 100, 200, 0, 0, 10, 0)),
]
TIMELINE_MIB = [(phase, tuple(v * 2**20 for v in row)) for phase, row in TIMELINE]


def _count(image: np.ndarray, rgb: np.ndarray) -> int:
    return int((np.abs(image.astype(int) - rgb).sum(axis=2) == 0).sum())


def test_the_picture_has_the_asked_size_and_a_readable_minimum() -> None:
    image = memory_picture(TIMELINE_MIB, 1024 * 2**20, width=640, height=320)
    assert image.shape == (320, 640, 3) and image.dtype == np.uint8
    assert memory_picture([], None, width=120, height=80).shape == (240, 400, 3)


def test_the_capacity_line_is_drawn_near_the_peak_and_named_off_scale() -> None:
    near = memory_picture(TIMELINE_MIB, 600 * 2**20, width=800, height=400)
    far = memory_picture(TIMELINE_MIB, 10**12, width=800, height=400)
    assert _count(near, CAPACITY_RED) > 300  # a line across the plot
    assert _count(far, CAPACITY_RED) == 0  # off scale: only named in the legend
    legend = [t.get_text() for t in memory_figure(TIMELINE_MIB, 10**12).axes[0].get_legend().get_texts()]
    assert "capacity 953,674.3 MiB (off scale)" in legend  # in MiB, as the plan writes it


def test_axes_say_phases_and_units_and_the_categories_are_stacked() -> None:
    figure = memory_figure(TIMELINE_MIB, 600 * 2**20)
    ax = figure.axes[0]
    assert ax.get_ylabel() == "live tensor memory (MiB)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["forward", "backward", "optimizer"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend[: len(CATEGORIES)] == list(CATEGORIES)
    assert "capacity 600.0 MiB" in legend and "live tensors' peak 410.0 MiB" in legend
    top = max(ax.collections, key=lambda c: c.get_paths()[0].vertices[:, 1].max())  # the last stack
    assert top.get_paths()[0].vertices[:, 1].max() == pytest.approx(410.0)  # stacked: the sum, in MiB
    gib = memory_figure([(p, tuple(v * 2**10 for v in row)) for p, row in TIMELINE_MIB], None)
    assert gib.axes[0].get_ylabel() == "live tensor memory (GiB)"


def test_the_figure_goes_to_add_figure_and_png_unchanged(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    figure = memory_figure(TIMELINE_MIB, 600 * 2**20, width=500, height=300)
    image = figure_image(figure)
    png = png_bytes(image)
    assert Image.open(io.BytesIO(png)).size == (500, 300)
    with SummaryWriter(str(tmp_path)) as writer:
        writer.add_figure("memory", memory_figure(TIMELINE_MIB, None), 0)
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    events.Reload()
    assert events.Tags()["images"] == ["memory"]


def test_the_monitor_saves_the_png_and_the_tensorboard_image(tmp_path: Path) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
    batch = torch.randn(32, 64)
    est = estimate_memory(model, torch.optim.AdamW(model.parameters()), batch, lambda m, b: m(b).sum())
    mon = RunMonitor(tmp_path, estimate=est, capacity_bytes=2 * est.peak_bytes, profile=False, summary=False)
    mon.start()
    mon.batch_ready(batch)
    mon.step_end()
    mon.close()
    saved = Image.open(tmp_path / "memory.png")
    assert saved.format == "PNG" and saved.size == (960, 480)
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    events.Reload()
    (event,) = events.Images("resource_guard/memory")
    assert (event.width, event.height) == (960, 480)
    assert Image.open(io.BytesIO(event.encoded_image_string)).size == (960, 480)


def test_matplotlib_is_imported_only_to_draw_and_pyplot_never() -> None:
    code = textwrap.dedent(
        """
        import sys
        import resource_guard.report.tensorboard as tb
        import resource_guard.observe.monitor
        assert "matplotlib" not in sys.modules, "imported before drawing"
        tb.memory_picture([("forward", (1, 2, 3, 4, 5, 6, 7))], 100)
        assert "matplotlib.figure" in sys.modules
        assert "matplotlib.pyplot" not in sys.modules, "pyplot changes global state"
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_guards_memory_png_draws_the_capacity_the_plan_used_not_the_hosts_ram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``resource-guard demo`` plans under a 256 MiB cap on the CPU: the picture's line is that cap (the
    report still holds the process RSS against the host's RAM, which is what it measures)."""
    from torch.utils.data import DataLoader, TensorDataset

    from resource_guard import guard
    from resource_guard.observe import outputs

    drawn: list[int | None] = []

    def recording(timeline: object, capacity_bytes: int | None, **kwargs: object) -> np.ndarray:
        drawn.append(capacity_bytes)
        return memory_picture(timeline, capacity_bytes, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(outputs, "memory_picture", recording)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    loader = DataLoader(TensorDataset(torch.randn(128, 32), torch.randn(128, 1)), batch_size=64)

    def loss_fn(m: torch.nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.mse_loss(m(b[0]), b[1])

    optimizer = torch.optim.AdamW(model.parameters())
    limit = 2 * estimate_memory(model, optimizer, next(iter(loader)), loss_fn, device="cpu").peak_bytes
    with guard(model, optimizer, loss_fn=loss_fn, memory_limit=limit, log_dir=tmp_path, profile=False) as g:
        for batch in g.iterate(loader):
            g.backward(loss_fn(model, batch))
    assert g.plan is not None and g.plan.fit.capacity_bytes == limit
    assert drawn == [limit]
    png = np.asarray(Image.open(tmp_path / "memory.png").convert("RGB"))
    assert _count(png, CAPACITY_RED) > 300  # drawn across the plot, not "off scale" as the host's RAM was
