"""Tests for resource_guard.cli: ``resource-guard preflight`` and ``resource-guard devices``.

Exit codes: 0 fits, 1 does not fit, 2 bad input (one paragraph on stderr, never a traceback).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from resource_guard.cli import format_bytes, main

# Small factories: the model returns its scalar loss unless a loss_fn is given; estimates take ~0.1 s.
FACTORIES = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.body(x), y)


def _batch(batch_size):
    return torch.randn(batch_size, 8), torch.randint(0, 3, (batch_size,))


def build(batch_size=4):
    model = Net()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), _batch(batch_size)


def build_with_loss_fn(batch_size=4):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))  # returns logits, not a loss

    def loss_fn(model, batch):
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    return model, torch.optim.AdamW(model.parameters()), _batch(batch_size), loss_fn


def build_mapping(batch_size=4):
    model, optimizer, batch = build(batch_size)
    return {"model": model, "optimizer": optimizer, "batch": batch}


def no_batch_size():
    return build()


def raises(batch_size=4):
    raise RuntimeError("the factory exploded")


def not_a_module(batch_size=4):
    model, optimizer, batch = build(batch_size)
    return (lambda x, y: model(x, y)), optimizer, batch


def foreign_optimizer(batch_size=4):
    model, _, batch = build(batch_size)
    other = nn.Linear(5, 7)
    return model, torch.optim.SGD(other.parameters(), lr=0.1), batch


def two_items(batch_size=4):
    return build(batch_size)[:2]


def five_items(batch_size=4):
    return (*build(batch_size), None, None)


def a_string(batch_size=4):
    return "abc"


def mapping_without_batch(batch_size=4):
    model, optimizer, _ = build(batch_size)
    return {"model": model, "optimizer": optimizer}


NOT_CALLABLE = 3
"""

TINY_CATALOG = """
devices:
  - {name: tiny-gpu, kind: cuda, memory: 64MiB, bf16: true}
  - {name: roomy-gpu, kind: cuda, memory: 80GiB, bf16: true}
"""


@pytest.fixture(scope="module")
def factories(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``factory.py`` with the factories above, next to a malformed ``bad.yaml`` catalog."""
    path = tmp_path_factory.mktemp("targets") / "factory.py"
    path.write_text(FACTORIES)
    (path.parent / "bad.yaml").write_text("devices:\n  - name: x\n    kind: [unclosed\n")
    return path


@pytest.fixture(scope="module")
def tiny_catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("catalogs") / "devices.yaml"
    path.write_text(TINY_CATALOG)
    return path


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def _json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    code, out, err = _run([*argv, "--json"], capsys)
    assert err == ""
    return code, json.loads(out)


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _bytes(text: str) -> float:
    number, unit = text.split()
    return float(number) * _UNITS[unit]


# --- preflight: the embedded default -----------------------------------------------------------


def test_preflight_without_target_estimates_the_demo_and_prints_the_breakdown(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _run(["preflight"], capsys)
    assert (code, err) == (0, "")
    assert out.startswith("resource-guard preflight: resource_guard.demo:build\n")
    assert re.search(r"batch 16, 32-true, ", out)  # demo.build's default batch_size
    assert "method: traced (every operator" in out
    block = out.split("live tensor memory at the peak")[1].split("\n\n")[0]
    rows = dict(re.findall(r"^  (\w+) +(\d+(?:\.\d+)? (?:B|KiB|MiB|GiB|TiB))$", block, re.MULTILINE))
    categories = ["parameters", "gradients", "optimizer_state", "activations", "temporaries", "inputs"]
    assert set(categories) <= set(rows) and "peak" in rows
    values = {name: _bytes(text) for name, text in rows.items()}
    assert values["parameters"] > 0 and values["optimizer_state"] > values["parameters"]  # AdamW: 2 moments
    assert sum(v for k, v in values.items() if k != "peak") == pytest.approx(values["peak"], rel=0.01)
    assert re.search(r"^  FITS, .+ to spare within the headroom$", out, re.MULTILINE)
    assert "DOES NOT FIT" not in out


# --- preflight: a factory file -----------------------------------------------------------------


@pytest.mark.parametrize("factory", ["build", "build_with_loss_fn", "build_mapping"])
def test_factory_file_target_and_batch_size_reach_the_estimate(
    factories: Path, factory: str, capsys: pytest.CaptureFixture[str]
) -> None:
    target = f"{factories}:{factory}"
    code, payload = _json(["preflight", target, "--batch-size", "7", "--device", "a100-40gb"], capsys)
    assert code == 0
    estimate, fit = payload["estimate"], payload["fit"]
    assert payload["target"] == target
    assert estimate["batch_size"] == 7  # the factories default to 4
    assert estimate["method"] == "traced" and estimate["warnings"] == []  # loss_fn was used, not dropped
    assert estimate["parameter_count"] == 8 * 16 + 16 + 16 * 3 + 3
    assert estimate["peak_bytes"] > 0 and estimate["device_kind"] == "cuda"
    assert (fit["device"], fit["fits"]) == ("a100-40gb", True)
    assert {f["device"] for f in payload["other_devices"]} >= {"t4", "h100-sxm"}


def test_batch_size_changes_the_estimate(factories: Path, capsys: pytest.CaptureFixture[str]) -> None:
    peaks = []
    for batch_size in ("2", "4096"):
        code, payload = _json(["preflight", f"{factories}:build", "--batch-size", batch_size], capsys)
        assert code == 0 and payload["estimate"]["batch_size"] == int(batch_size)
        peaks.append(payload["estimate"]["peak_bytes"])
    assert peaks[1] > peaks[0]


def test_json_output_has_the_documented_fields(factories: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, payload = _json(["preflight", f"{factories}:build", "--device", "cpu"], capsys)
    assert code == 0
    assert isinstance(payload["estimate"]["peak_bytes"], int) and payload["estimate"]["peak_bytes"] > 0
    assert payload["fit"]["fits"] is True and payload["fit"]["device"] == "cpu"
    assert payload["fit"]["device_total_bytes"] >= payload["estimate"]["peak_bytes"]


def test_precision_option_reaches_the_estimate(factories: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["preflight", f"{factories}:build", "--device", "a100-40gb", "--precision", "bf16-mixed"]
    code, payload = _json(argv, capsys)
    assert code == 0 and payload["estimate"]["precision"] == "bf16-mixed"


# --- preflight: does not fit -------------------------------------------------------------------


def test_exit_1_when_the_step_does_not_fit_a_catalog_device(
    factories: Path, tiny_catalog: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["preflight", f"{factories}:build", "--catalog", str(tiny_catalog)]
    code, out, err = _run([*argv, "--device", "tiny-gpu"], capsys)
    assert (code, err) == (1, "")
    assert "on tiny-gpu (cuda, 64.00 MiB)" in out and "  DOES NOT FIT: needs " in out and "FITS," not in out
    code, payload = _json([*argv, "--device", "tiny_gpu"], capsys)
    assert code == 1 and payload["fit"]["fits"] is False and payload["fit"]["device"] == "tiny-gpu"
    code, out, _ = _run([*argv, "--device", "roomy-gpu"], capsys)  # same catalog, room to spare
    assert code == 0 and "on roomy-gpu (cuda, 80.00 GiB)" in out and "  FITS, " in out


def test_other_devices_are_a_table_with_a_verdict_each_never_none(
    factories: Path, tiny_catalog: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["preflight", f"{factories}:build", "--catalog", str(tiny_catalog), "--device", "tiny-gpu"]
    code, out, _ = _run(argv, capsys)
    assert code == 1
    section = out.split("\nother devices")[1]
    assert "none" not in section  # every compared device fits here: no "not on none"
    rows = dict(re.findall(r"^  ([\w-]+) .* (fits|does not fit)$", section, re.MULTILINE))
    assert {"t4", "a100-40gb", "h100-sxm"} <= set(rows) and set(rows.values()) == {"fits"}
    assert "\x1b[" not in out and "|" not in out and "**" not in out


def test_exit_1_for_the_demo_on_a_small_catalog_device(
    tiny_catalog: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["preflight", "--device", "tiny-gpu", "--catalog", str(tiny_catalog), "--batch-size", "2"]
    code, out, err = _run(argv, capsys)
    assert (code, err) == (1, "") and "DOES NOT FIT" in out


def test_fits_tight_exits_0_with_a_warning_line_and_1_under_strict(
    factories: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["preflight", f"{factories}:build"]
    _, payload = _json([*argv, "--device", "a100-40gb"], capsys)
    total = payload["fit"]["device_total_bytes"]
    catalog = tmp_path / "tight.yaml"  # the device total is 95% of this device: inside the 10% headroom
    kib = int(total / 0.95 // 1024)
    catalog.write_text(
        "devices:\n  - {name: snug-gpu, kind: cuda, "
        f"memory: {kib}KiB, bf16: true, compute_capability: '8.0'}}\n"
    )
    tight = [*argv, "--catalog", str(catalog), "--device", "snug-gpu"]
    code, out, err = _run(tight, capsys)
    assert code == 0 and "  FITS TIGHT: " in out and "DOES NOT FIT" not in out
    assert err.startswith("warning: fits tight, within the 10% headroom: ") and err.count("\n") == 1
    code, _, err = _run([*tight, "--strict"], capsys)
    assert code == 1 and err.startswith("warning: fits tight")
    code, payload = _json([*tight, "--headroom", "0"], capsys)  # no headroom: simply fits
    assert code == 0 and payload["fit"]["verdict"] == "fits"


# --- preflight: bad input ----------------------------------------------------------------------

_BAD_INPUTS = {
    "factory file missing": (["{dir}/absent.py:build"], ["absent.py", "does not exist"]),
    "module missing": (["resource_guard.no_such_module:build"], ["cannot import module", "no_such_module"]),
    "attribute missing in a module": (["resource_guard.demo:no_such_factory"], ["no callable", "build"]),
    "attribute missing in a file": (["{factories}:no_such_factory"], ["no callable", "build_mapping"]),
    "attribute not callable": (["{factories}:NOT_CALLABLE"], ["no callable 'NOT_CALLABLE'"]),
    "no factory named": (["{factories}"], ["must be `path/to/file.py:factory`"]),
    "factory raises": (["{factories}:raises"], ["raised RuntimeError: the factory exploded"]),
    "model not an nn.Module": (["{factories}:not_a_module"], ["nn.Module", "function"]),
    "optimizer over another model": (
        ["{factories}:foreign_optimizer"],
        ["not the model's", "(7, 5)", "model.parameters()"],
    ),
    "unknown device": (["{factories}:build", "--device", "a100-40g"], ["'a100-40g'", "'a100-40gb'"]),
    "absent local device": (["{factories}:build", "--device", "cuda:7"], ["cuda:7 does not exist"]),
    "unknown precision": (["{factories}:build", "--precision", "fp17"], ["'fp17'", "bf16-mixed"]),
    "malformed catalog": (["{factories}:build", "--catalog", "{dir}/bad.yaml"], ["bad.yaml", "YAML"]),
    "missing catalog": (["{factories}:build", "--catalog", "{dir}/absent.yaml"], ["absent.yaml"]),
    "batch size 0": (["{factories}:build", "--batch-size", "0"], ["--batch-size 0", "positive"]),
    "negative batch size": (["{factories}:build", "--batch-size", "-3"], ["--batch-size -3"]),
    "headroom out of range": (["{factories}:build", "--headroom", "0.95"], ["--headroom 0.95"]),
    "batch size without parameter": (
        ["{factories}:no_batch_size", "--batch-size", "2"],
        ["--batch-size", "no `batch_size` argument"],
    ),
    "two items": (["{factories}:two_items"], ["returned tuple", "(model, optimizer, batch)"]),
    "five items": (["{factories}:five_items"], ["returned tuple", "(model, optimizer, batch)"]),
    "a string": (["{factories}:a_string"], ["returned str", "(model, optimizer, batch)"]),
    "mapping without batch": (["{factories}:mapping_without_batch"], ["without key 'batch'"]),
}


@pytest.mark.parametrize(("args", "fragments"), list(_BAD_INPUTS.values()), ids=list(_BAD_INPUTS))
def test_bad_input_exits_2_with_one_paragraph_and_no_traceback(
    factories: Path,
    args: list[str],
    fragments: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["preflight", *(a.format(factories=factories, dir=factories.parent) for a in args)]
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    assert err.startswith("resource-guard preflight: ") and err.endswith("\n")
    assert "\n" not in err.strip(), "one paragraph: a single line"
    for fragment in fragments:
        assert fragment in err


def test_importing_a_broken_factory_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import torch\nraise ImportError('needs a package you lack')\n")
    code, out, err = _run(["preflight", f"{broken}:build"], capsys)
    assert (code, out) == (2, "")
    assert "importing" in err and "ImportError: needs a package you lack" in err


@pytest.mark.parametrize("argv", [[], ["bogus"], ["preflight", "--batch-size", "many"]])
def test_command_line_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(argv, capsys)
    assert code == 2 and "usage: resource-guard" in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(["preflight", "--help"], capsys)
    assert code == 0 and "--batch-size" in out and "resource_guard.demo:build" in out


@pytest.mark.parametrize("command", [[], ["preflight"], ["devices"], ["demo"], ["report"]])
def test_help_is_plain_text(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """``--help`` is read in a terminal: no reST markup (double backticks, roles) from the docstrings."""
    code, out, _ = _run([*command, "--help"], capsys)
    assert code == 0 and out.startswith(" ".join(["usage: resource-guard", *command]))
    assert "``" not in out and not re.search(r":(class|func|mod|meth|attr):", out), out
    description = out.split("\n\n")[1]
    assert description[0].isupper() and description.rstrip().endswith("."), description


# --- devices -----------------------------------------------------------------------------------


def test_devices_lists_the_catalog_and_the_detected_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(["devices"], capsys)
    assert (code, err) == (0, "")
    catalog_part, detected_part = out.split("\ndetected on this machine:\n")
    assert re.search(r"^  a100-40gb +cuda +40\.00 GiB +yes +8\.0 +312 ", catalog_part, re.MULTILINE)
    assert re.search(r"^  cpu +cpu +\d", detected_part, re.MULTILINE)
    assert "\x1b[" not in out and "|" not in out  # not a terminal here: plain, aligned text


def test_devices_json(tiny_catalog: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, payload = _json(["devices"], capsys)
    assert code == 0
    by_name = {d["name"]: d for d in payload["catalog"]}
    assert by_name["a100-40gb"]["memory_bytes"] == 40 * 2**30 and by_name["a100-40gb"]["bf16"] is True
    assert [d["kind"] for d in payload["detected"]][-1] == "cpu"
    assert payload["detected"][-1]["name"] == "cpu" and payload["detected"][-1]["free_bytes"] > 0
    code, payload = _json(["devices", "--catalog", str(tiny_catalog)], capsys)
    assert code == 0 and "tiny-gpu" in {d["name"] for d in payload["catalog"]}


def test_devices_with_malformed_catalog_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices: [unclosed\n")
    code, out, err = _run(["devices", "--catalog", str(bad)], capsys)
    assert (code, out) == (2, "") and err.startswith("resource-guard devices: ") and "bad.yaml" in err


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (None, "-"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.50 KiB"),
        (3 * 2**30, "3.00 GiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_format_bytes(n: int | None, text: str) -> None:
    assert format_bytes(n) == text


# --- the installed console script --------------------------------------------------------------


@pytest.mark.slow
def test_console_script_preflights_the_demo_on_a_catalog_device() -> None:
    beside = Path(sys.executable).with_name("resource-guard")
    script = str(beside) if beside.exists() else shutil.which("resource-guard")
    assert script, "the `resource-guard` console script is not installed (pip install -e .)"
    done = subprocess.run(
        [script, "preflight", "--device", "a100-40gb"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, textwrap.shorten(done.stderr, 2000)
    assert "on a100-40gb (cuda, 40.00 GiB):" in done.stdout and "  FITS, " in done.stdout
    assert "Traceback" not in done.stderr


def test_a_reader_that_closes_the_pipe_early_gets_no_traceback(tmp_path: Path) -> None:
    """`resource-guard devices | head -1`: the output outlives its reader; the command ends quietly."""
    script = "import sys; from resource_guard.cli import main; sys.exit(main(['devices']))"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()  # gone before the command prints (its imports take a second): every write fails
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err
    assert proc.returncode in (0, 1)
