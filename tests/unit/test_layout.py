"""The test suite's layout: every test module in the folder of its tier, what modules share
in tests/support, and no test module importing another (tests/support/tiers.py, and
tests/support/place.py to place a newcomer)."""

from __future__ import annotations

from pathlib import Path

from place import fix_imports, one_level_deeper, stale_references
from tiers import TESTS, TIERS, folder_tier, imported_names, module_tier

SUPPORT = TESTS / "support"


def python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "corpus" not in p.relative_to(TESTS).parts)


def modules_of_tests() -> list[Path]:
    return [p for p in python_files() if p.name.startswith("test_")]


def test_every_test_module_sits_in_a_tier_folder() -> None:
    outside = [p.relative_to(TESTS) for p in modules_of_tests() if folder_tier(p) is None]
    assert not outside, f"place them: .venv/bin/python tests/support/place.py ({outside})"


def test_the_tier_folders_hold_test_modules_only() -> None:
    """A module the tests share goes to tests/support, where every test module finds it."""
    others = [
        p.relative_to(TESTS)
        for tier in TIERS
        for p in sorted((TESTS / tier).iterdir())
        if p.suffix == ".py" and not p.name.startswith("test_")
    ]
    assert not others


def test_the_top_of_tests_holds_the_conftest_only() -> None:
    """A module the tests share sits in tests/support, on sys.path for all of them."""
    top = sorted(p.name for p in TESTS.glob("*.py") if not p.name.startswith("test_"))
    assert top == ["conftest.py"]


def test_no_module_imports_a_test_module() -> None:
    stems = {p.stem for p in modules_of_tests()} | {"conftest"}
    imports = {
        f"{p.relative_to(TESTS)} imports {module}"
        for p in python_files()
        for module, _ in imported_names(p)
        if module.split(".")[0] in stems
    }
    assert not imports, "move what they share into tests/support"


def test_a_module_that_starts_derivd_is_an_acceptance_module() -> None:
    """The fixtures cannot tell (`derivd_command`, `DaemonRun`, `idle_daemon` are not
    fixtures): the imports can."""
    below = [
        p.relative_to(TESTS)
        for p in modules_of_tests()
        if module_tier(p) == "acceptance" and folder_tier(p) not in (None, "acceptance")
    ]
    assert not below


def test_the_rules_see_what_they_look_for(tmp_path: Path) -> None:
    """The checks above would catch a module that breaks them."""
    module = tmp_path / "test_newcomer.py"
    module.write_text(
        "from fixtures.daemon import DaemonRun\n"
        "def test_x():\n    from test_supervisor import kinds\n"
    )
    assert ("test_supervisor", "kinds") in imported_names(module)
    assert module_tier(module) == "acceptance"
    assert folder_tier(module) is None
    assert folder_tier(TESTS / "unit" / "test_layout.py") == "unit"


def test_placing_a_module_moves_its_paths_and_imports_along(tmp_path: Path) -> None:
    """What place.py does to a newcomer: paths from its own file reach one folder further
    up, a name it took from a test module comes from tests/support, old paths are named."""
    assert one_level_deeper('Path(__file__).resolve().parent / "corpus"') == (
        'Path(__file__).resolve().parents[1] / "corpus"'
    )
    assert one_level_deeper("Path(__file__).parent.parent") == "Path(__file__).parents[2]"
    assert one_level_deeper("Path(__file__).resolve().parents[1]") == (
        "Path(__file__).resolve().parents[2]"
    )
    module = tmp_path / "test_newcomer.py"
    module.write_text("from test_supervisor import FAST, supervisor  # noqa: F401\n")
    assert fix_imports(module) == []
    assert module.read_text() == "from fixtures.daemon import FAST\n"
    # Old paths spelt in pieces, or place.py --fix-references would rewrite them here too.
    queue, helpers = "tests/" + "test_queue.py", "tests/" + "helpers.py"
    moved = {"test_queue.py": "tests/integration/test_queue.py"}
    assert stale_references(f"see {queue} and {helpers}", moved) == [
        (queue, "tests/integration/test_queue.py"),
        (helpers, "tests/support/helpers.py"),
    ]
