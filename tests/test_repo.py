"""Repository facts: CI runs the README's test command; the package's layout."""

import ast
import contextlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = readme.split("```bash\n")
    commands = [b.split("\n```")[0].strip() for b in blocks[1:]]
    test_command = next(c for c in commands if c.endswith("pytest"))
    assert test_command in ci.splitlines()


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports, at its top level or inside functions:
    `from jaxlm import ops` imports `jaxlm.ops`, `from jaxlm.ops import matmul` `jaxlm.ops`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & modules
            found.update(submodules or {node.module})
    return found & modules


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_package_has_no_import_cycles():
    modules = {_module_name(p): p for p in (ROOT / "jaxlm").rglob("*.py")}

    graph = {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}
    state: dict[str, str] = {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                raise AssertionError(
                    "import cycle: " + " -> ".join([*stack[stack.index(dep) :], dep])
                )
            elif dep not in state:
                visit(dep, [*stack, dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


BACKEND_QUERIES = {"platform", "devices", "device_count", "default_backend", "local_devices"}


def test_models_and_layers_never_ask_for_the_backend():
    # Products that lower differently per backend belong to `jaxlm.ops`; the model files and
    # the layers are the models' math.
    files = [ROOT / "jaxlm" / "layers.py", *(ROOT / "jaxlm" / "models").glob("*.py")]
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            name = getattr(node, "attr", None) or getattr(node, "id", None)
            assert name not in BACKEND_QUERIES, f"{path.name}:{node.lineno} uses `{name}`"


def test_a_file_opened_outside_the_repository_is_caught():
    # `conftest` fails the session if a test opened such a file; this proves that it sees one,
    # beside the repository or anywhere else outside it.
    import conftest

    for outside in (
        ROOT.parent / "shared" / "reference" / "smollm2_llamacpp.json",
        Path("/") / "jaxlm-outside-the-repository.json",
    ):
        with contextlib.suppress(OSError), open(outside):
            pass
        assert str(outside) in conftest.opened_outside
        conftest.opened_outside.discard(str(outside))
    with open(ROOT / "tests" / "data" / "smollm2_llamacpp.json"):
        pass
    assert not conftest.opened_outside
