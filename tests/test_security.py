"""A config file is data (issue 41): nothing a YAML (or the config a sidecar recorded) says alone makes the tool run a
command or call arbitrary code; the command line, or ``--trust_config``, opts in. Each refusal is exit 2 naming the
key, before any work, with every file as it was and the marker a command would have written absent."""

from __future__ import annotations

import json
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import pytest
from torch import nn

from analysis.config import GlobalConfig, load_config
from analysis.errors import ConfigError, ModelError, UserError
from analysis.inputs.models import build_model
from analysis.runtimes.runtime import CommandRuntime

import tiny_models
from helpers import TINY_MODELS, CliResult, assert_user_error, tiny_global, write_config

Cli = Callable[..., CliResult]
MARKER = "MARKER"


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def latency_config(tmp_path: Path, data: Path, name: str = "c.yaml", **analysis: object) -> Path:
    """A config ``name`` planning a 20% latency cut of the tiny CNN, with ``analysis`` keys added."""
    section = {"analysis_file": str(tmp_path / "out" / "s.pkl"), "pruned_ratios": [0.5],
               "target_latency_reduction": 0.2, **analysis}  # fmt: skip
    return write_config(tmp_path / name, {"Global": tiny_global(data), "SensitivityAnalysis": section})


def touching(marker: Path) -> str:
    """A runtime command template that would create ``marker`` if it ran."""
    return f'sh -c "touch {marker}; echo 1.0" {{onnx}}'


# ---- runtime_command -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["", "plan"])
def test_a_config_file_alone_cannot_run_a_runtime_command(
    cli: Cli, tmp_path: Path, list_data: Path, command: str
) -> None:
    marker = tmp_path / MARKER
    config = latency_config(tmp_path, list_data, latency_runtime="command", runtime_command=touching(marker))
    before = snapshot(tmp_path)
    result = cli(*([command] if command else []), "--config_path", config)
    assert_user_error(result, rf"SensitivityAnalysis\.runtime_command in {config} runs a command.*--trust_config")
    assert not marker.exists()
    assert snapshot(tmp_path) == before  # nothing written: refused before any work


def test_a_runtime_command_recorded_in_a_sidecar_does_not_run_on_verify(
    cli: Cli, tmp_path: Path, list_data: Path
) -> None:
    """The config a sidecar records is a file like any other: an analysis file can be shared too."""
    config = latency_config(tmp_path, list_data)
    assert cli("--config_path", config, "SensitivityAnalysis.target_latency_reduction=null",
               "SensitivityAnalysis.report=false").code == 0  # fmt: skip
    sidecar = tmp_path / "out" / "s.pkl.json"
    data = json.loads(sidecar.read_text())
    marker = tmp_path / MARKER
    data["config"]["SensitivityAnalysis"].update(latency_runtime="command", runtime_command=touching(marker))
    sidecar.write_text(json.dumps(data))
    ratios = tmp_path / "r.yaml"
    ratios.write_text("ChannelPrune:\n  prune_params_name: [0.weight]\n  pruned_ratio: [0.5]\n")
    before = snapshot(tmp_path)
    result = cli("verify", tmp_path / "out" / "s.pkl", "--ratios", ratios, "--no_report")
    assert_user_error(
        result, r"SensitivityAnalysis\.runtime_command in the config .*s\.pkl\.json recorded runs a command"
    )
    assert not marker.exists() and snapshot(tmp_path) == before


def test_the_command_line_or_trust_config_opts_in(tmp_path: Path, list_data: Path) -> None:
    template = touching(tmp_path / MARKER)
    config = latency_config(tmp_path, list_data, latency_runtime="command", runtime_command=template)
    trusted = load_config(config, trust_config=True)
    assert trusted.SensitivityAnalysis.runtime_command == template
    plain = latency_config(tmp_path, list_data, "plain.yaml", latency_runtime="command")
    given = load_config(plain, [f"SensitivityAnalysis.runtime_command={template}"])
    assert given.SensitivityAnalysis.runtime_command == template
    flagged = load_config(plain, flags={"SensitivityAnalysis.runtime_command": template})
    assert flagged.SensitivityAnalysis.runtime_command == template
    with pytest.raises(ConfigError, match=r"runtime_command in .*c\.yaml runs a command"):
        load_config(config)


@pytest.mark.parametrize("key", ["trust_model_file", "trust_arch"])
def test_a_config_file_alone_cannot_grant_trust(cli: Cli, tmp_path: Path, list_data: Path, key: str) -> None:
    config = write_config(tmp_path / "c.yaml", {"Global": tiny_global(list_data, **{key: True})})
    result = cli("--config_path", config)
    assert_user_error(result, rf"Global\.{key} in .*c\.yaml .*cannot ask for on its own.*Global\.{key}=true")
    assert not (tmp_path / "outputs").exists()
    assert getattr(load_config(config, [f"Global.{key}=true"]).Global, key) is True
    assert getattr(load_config(config, trust_config=True).Global, key) is True


# ---- Global.arch: a model, not any callable ------------------------------------------------------------------------

DANGEROUS = {
    "os:system": {"command": f"touch {MARKER}"},
    "subprocess:run": {"args": ["touch", MARKER]},
    "builtins:exec": {"source": f"open('{MARKER}', 'w')"},
    "builtins:eval": {"source": f"open('{MARKER}', 'w')"},
    "shutil:copyfile": {"src": __file__, "dst": MARKER},
    "runpy:run_path": {"path_name": MARKER},
    "importlib:import_module": {"name": "antigravity"},
    "pickle:loads": {"data": b"x"},
    "antigravity:geohash": {},  # importing it acts (it opens a web browser)
    "torch:load": {"f": MARKER, "weights_only": False},
    "torch.hub:load": {"repo_or_dir": ".", "model": "m", "source": "local"},
    "torch.hub:os.system": {"command": f"touch {MARKER}"},  # a stdlib function reached through a package
    "torch.nn:Module.__subclasses__": {},
    f"{TINY_MODELS}:not_a_model": {},  # a user function that says it returns a str
}


@pytest.mark.parametrize("arch", list(DANGEROUS))
def test_global_arch_refuses_anything_but_a_model(cli: Cli, tmp_path: Path, list_data: Path, arch: str) -> None:
    config = write_config(
        tmp_path / "c.yaml", {"Global": tiny_global(list_data, arch=arch, arch_kwargs=DANGEROUS[arch])}
    )
    imported = set(sys.modules)
    result = cli("--config_path", config)
    assert_user_error(result, r"Global\.arch .* (refused|may only name a model).*Global\.trust_arch=true")
    assert not (tmp_path / MARKER).exists()
    assert "antigravity" not in set(sys.modules) - imported  # a refused module is not even imported
    with pytest.raises(ModelError, match=r"Global\.arch"):  # the Python API too, with no config in between
        build_model(GlobalConfig(arch=arch, arch_kwargs=DANGEROUS[arch]))
    assert not (tmp_path / MARKER).exists()


def test_a_model_file_inside_the_python_installation_is_refused(tmp_path: Path, list_data: Path) -> None:
    library_file = Path(sysconfig.get_paths()["stdlib"]) / "this.py"  # importing it prints the Zen of Python
    config = write_config(tmp_path / "c.yaml", {"Global": tiny_global(list_data, arch=f"{library_file}:s")})
    with pytest.raises(ConfigError, match=r"lies in the Python installation"):
        load_config(config)


def test_an_unannotated_function_needs_trust_arch(tmp_path: Path) -> None:
    module = tmp_path / "my_models.py"
    module.write_text(
        "import torch\n\ndef build(num_classes=10):\n    return torch.nn.Sequential(torch.nn.Flatten(), "
        "torch.nn.LazyLinear(num_classes))\n\nclass Plain:\n    def __init__(self, num_classes=10):\n        pass\n"
    )
    for name, what in (("build", "return annotation"), ("Plain", "not a torch.nn.Module subclass")):
        with pytest.raises(ModelError, match=rf"{what}.*Annotate it, or pass Global\.trust_arch=true"):
            build_model(GlobalConfig(arch=f"{module}:{name}"))
    assert isinstance(build_model(GlobalConfig(arch=f"{module}:build", trust_arch=True)), nn.Module)


@pytest.mark.parametrize(
    "arch", [f"{TINY_MODELS}:tiny_cnn", "torchvision.models:resnet18", "torchvision.models.resnet:ResNet18_Weights"]
)
def test_models_and_annotated_factories_are_accepted(arch: str) -> None:
    """tiny_cnn's annotation is a string (``from __future__ import annotations``), resolved without eval;
    torchvision's builders are decorated (functools.wraps keeps the annotation)."""
    if arch.endswith("Weights"):  # an enum class, not a model: refused
        with pytest.raises(ModelError, match=r"not a torch\.nn\.Module subclass"):
            build_model(GlobalConfig(arch=arch))
        return
    kwargs = {"num_classes": 10}
    assert isinstance(build_model(GlobalConfig(arch=arch, arch_kwargs=kwargs)), nn.Module)


# ---- the command template --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "template",
    ["bench {onnx!r}", "bench {onnx:>40}", "bench {onnx.__class__}", "bench {0} {onnx}", "bench {} {onnx}",
     "bench {onnx", "bench '{onnx}", "sh -c \"bench '{onnx}'\"", "bench --batch {batch}"],
)  # fmt: skip
def test_a_bad_template_is_refused_when_the_config_is_read(tmp_path: Path, list_data: Path, template: str) -> None:
    config = latency_config(tmp_path, list_data, latency_runtime="command")
    with pytest.raises(ConfigError, match=r"SensitivityAnalysis\.runtime_command"):
        load_config(config, [f"SensitivityAnalysis.runtime_command={json.dumps(template)}"])


def test_a_bad_pattern_is_refused_when_the_config_is_read(tmp_path: Path, list_data: Path) -> None:
    config = latency_config(tmp_path, list_data, latency_runtime="command")
    for pattern, problem in (("(unclosed", "not a regular expression"), ("no group", "one group")):
        with pytest.raises(ConfigError, match=rf"SensitivityAnalysis\.runtime_pattern .*{problem}"):
            load_config(config, ["SensitivityAnalysis.runtime_command=bench {onnx}",
                                 f"SensitivityAnalysis.runtime_pattern={json.dumps(pattern)}"])  # fmt: skip


ARGUMENTS = "import os, sys; assert len(sys.argv) == 2 and os.path.isfile(sys.argv[1]), sys.argv; print(2.5)"


@pytest.mark.parametrize("folder", ["with space", "with 'quote", 'with "double', "with $(touch MARKER) inside"])
def test_the_model_path_is_one_argument_and_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: str
) -> None:
    """The temporary ONNX file's path comes from TMPDIR: whatever it holds stays one argument, and inside a
    ``sh -c`` script it is quoted, so ``$(...)`` in it is never run."""
    temporary = tmp_path / folder
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    monkeypatch.setattr("tempfile.tempdir", None)
    model, shape = tiny_models.tiny_cnn().eval(), (3, 8, 8)
    direct = CommandRuntime(f'{sys.executable} -c "{ARGUMENTS}" {{onnx}}')
    assert direct.measure(model, shape, 1).median_ms == 2.5
    shell = CommandRuntime('sh -c "test -f {onnx} && echo {shape} && echo 1.5"')
    assert shell.measure(model, shape, 1).median_ms == 1.5
    assert not (tmp_path / MARKER).exists() and not Path(MARKER).exists()


def test_values_are_quoted_only_inside_a_shell_script() -> None:
    from analysis.command_template import CommandTemplate

    path = "/tmp/a b/$(touch x)/m.onnx"
    values = {"onnx": path, "batch": "1", "shape": "1x3x8x8"}
    assert CommandTemplate.parse("trtexec --onnx={onnx}").render(values) == ["trtexec", f"--onnx={path}"]
    script = CommandTemplate.parse('bash -ec "bench {onnx} | tail -1"').render(values)
    assert script == ["bash", "-ec", "bench '/tmp/a b/$(touch x)/m.onnx' | tail -1"]


@pytest.mark.parametrize("output", ["shape 1x3x224x224 latency: nan", "took inf ms", "latency 4.0\nthen -inf"])
def test_a_command_printing_inf_or_nan_has_no_latency(output: str) -> None:
    """Before, inf and nan were not numbers to the parser, which took the digits printed before them (224)."""
    runtime = CommandRuntime("bench {onnx}")
    with pytest.raises(UserError, match="printed no latency"):
        runtime._latency(output)
    assert runtime._latency("shape 1x3x224x224 latency: 3.25 ms") == 3.25


# ---- latency settings: given means used, validated up front ----------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (["--target_latency_reduction", "0.2", "--runtime", "torch", "--runtime_command", "bench {onnx}"],
         r"runtime_command \(--runtime_command\) would be ignored: it applies only to latency_runtime: command"),
        (["--target_latency_reduction", "0.2", "--runtime_command", "bench {onnx}"],
         r"runtime_command \(--runtime_command\) would be ignored: .*the runtime is auto"),
        (["--target_latency_reduction", "0.2", "--runtime", "torch", "SensitivityAnalysis.runtime_pattern=(\\d+)"],
         r"SensitivityAnalysis\.runtime_pattern would be ignored"),
        (["--target_macs_reduction", "0.3", "--latency_table", "layers"], r"latency_table \(--latency_table\)"),
        (["--target_macs_reduction", "0.3", "--latency_batch", "8"], r"latency_batch \(--latency_batch\)"),
        (["--target_macs_reduction", "0.3", "--latency_round_to", "1"], r"latency_round_to \(--latency_round_to\)"),
        (["--target_macs_reduction", "0.3", "--runtime", "onnxruntime"], r"latency_runtime \(--runtime\) would be"),
    ],
)  # fmt: skip
def test_latency_flags_that_nothing_uses_are_refused_before_any_work(
    cli: Cli, tmp_path: Path, list_data: Path, arguments: list[str], named: str
) -> None:
    config = latency_config(tmp_path, list_data, target_latency_reduction=None)
    before = snapshot(tmp_path)
    assert_user_error(cli("plan", "--config_path", config, *arguments), named)
    assert snapshot(tmp_path) == before


def test_verify_uses_the_runtime_so_it_is_accepted_there(tmp_path: Path, list_data: Path) -> None:
    from analysis.config import unused_latency_settings

    config = latency_config(tmp_path, list_data, target_latency_reduction=None, verify=True, target_loss=0.1)
    assert unused_latency_settings(load_config(config, ["SensitivityAnalysis.latency_runtime=torch"])) == {}
    batch_only = load_config(config, ["SensitivityAnalysis.latency_batch=4"])
    assert unused_latency_settings(batch_only) == {}  # timed on the auto runtime at that batch
    assert "latency_table" in unused_latency_settings(load_config(config, ["SensitivityAnalysis.latency_table=layers"]))


def test_unused_latency_settings_of_a_file_are_warned_about_not_refused(
    tmp_path: Path, list_data: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from analysis.config import check_latency_settings_used

    config = load_config(latency_config(tmp_path, list_data, target_latency_reduction=None, latency_batch=8))
    check_latency_settings_used(config)
    assert "SensitivityAnalysis.latency_batch (--latency_batch) from" in caplog.text and "is ignored" in caplog.text


def test_a_command_line_latency_budget_replaces_the_files_other_form(tmp_path: Path, list_data: Path) -> None:
    config = latency_config(tmp_path, list_data)  # the file says target_latency_reduction: 0.2
    flagged = load_config(config, flags={"SensitivityAnalysis.target_latency_ms": 3.0}).SensitivityAnalysis
    assert (flagged.target_latency_ms, flagged.target_latency_reduction) == (3.0, None)
    overridden = load_config(config, ["SensitivityAnalysis.target_latency_ms=3"]).SensitivityAnalysis
    assert (overridden.target_latency_ms, overridden.target_latency_reduction) == (3.0, None)
    with pytest.raises(ConfigError, match="both set"):  # both on the command line: still one too many
        load_config(
            config, ["SensitivityAnalysis.target_latency_ms=3", "SensitivityAnalysis.target_latency_reduction=0.1"]
        )
