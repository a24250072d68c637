"""The exported ``pruned_model.pt`` loads with ``torch.load(weights_only=False)`` in a new process, whatever form
``Global.arch`` took, or its export says plainly how to load it (issue 17)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from helpers import REPO, CliResult, tiny_global, write_config

LOAD = ("import torch; model = torch.load({path!r}, weights_only=False); "
        "print(type(model).__module__, model(torch.zeros(2, 3, 16, 16)).shape)")  # fmt: skip


def export_config(tmp_path: Path, data: Path, arch: str) -> Path:
    """Analyse ``arch`` at ratio 0.5, derive ratios for a loss of 0.5 and export the pruned model to tmp_path/export."""
    return write_config(tmp_path / "c.yaml", {
        "Global": tiny_global(data, arch=arch, arch_kwargs={"num_classes": 10, "delay": 0.0}),
        "SensitivityAnalysis": {"analysis_file": str(tmp_path / "s.pkl"), "pruned_ratios": [0.5], "target_loss": 0.5,
                                "export_dir": str(tmp_path / "export")},
    })  # fmt: skip


def python(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter started in ``cwd``."""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_a_model_file_inside_the_project_loads_in_a_new_process_started_there(tmp_path: Path, list_data: Path) -> None:
    """``python run.py`` from the project root, a model file under it: the pickle names the class by its dotted
    path, which a new interpreter started in the root imports."""
    config = export_config(tmp_path, list_data, "tests/engine_models.py:slow_cnn")
    run = subprocess.run([sys.executable, "run.py", "--config_path", str(config), "--no_report"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "loading" not in json.loads((tmp_path / "export" / "pruned_channels.json").read_text())
    loaded = python(LOAD.format(path=str(tmp_path / "export" / "pruned_model.pt")), cwd=REPO)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["tests.engine_models", "torch.Size([2,", "10])"]


def test_a_model_file_outside_the_import_path_says_how_to_load_it(
    cli: Callable[..., CliResult], tmp_path: Path, list_data: Path
) -> None:
    folder = tmp_path / "my models"  # a space: no dotted name reaches it
    folder.mkdir()
    shutil.copy(REPO / "tests" / "engine_models.py", folder / "net.py")
    result = cli("--config_path", export_config(tmp_path, list_data, str(folder / "net.py:slow_cnn")), "--no_report")
    assert result.code == 0, result.err
    note = json.loads((tmp_path / "export" / "pruned_channels.json").read_text())["loading"]
    assert f"its classes come from {folder / 'net.py'}, outside the folders Python imports from" in note
    assert f"warning: pruned_model.pt: {note}" in result.err
    model_file = str(tmp_path / "export" / "pruned_model.pt")
    assert python(LOAD.format(path=model_file), cwd=tmp_path).returncode != 0  # the note is needed
    instructions = note.partition("so torch.load needs them imported first: ")[2].partition("; or rebuild")[0]
    loaded = python(f"{instructions}; {LOAD.format(path=model_file)}", cwd=REPO)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split()[0].startswith("_arch_net_")
