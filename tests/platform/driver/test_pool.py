"""hardware.pool: the Ray resource a plan's workers ask for, so the plan runs on the devices it assumed.

What the platform asks of a real autoscaling cluster is tested in test_remote_cluster.py; here the
key itself, and the local Ray that a run without a cluster provides the pool on.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import RECIPES
from osdp_planners.errors import UserErrors
from osdp_platform.driver.cluster import pool_request
from osdp_platform.recipe.loader import load_recipe


@pytest.mark.parametrize(
    ("preset", "pool"),
    [
        ("a100-40gb", "A100_40GB"),
        ("a100-80gb", "A100_80GB"),
        ("h100-80gb", "H100_80GB"),
        ("h200-141gb", "H200_141GB"),
        ("rtx-titan-24gb", "RTX_TITAN_24GB"),
    ],
)
def test_a_gpu_recipe_asks_for_its_presets_pool(preset: str, pool: str) -> None:
    hw = load_recipe(RECIPES / "llama.yaml", [f"hardware.preset={preset}"]).hardware
    assert hw.pool == "auto" and hw.pool_resource == pool
    assert pool_request(hw) == {pool: 1.0}


@pytest.mark.parametrize(
    ("overrides", "resource"),
    [
        ([], None),  # a CPU recipe: no pool unless it names one
        (["hardware.pool=any"], None),
        (["hardware.pool=SPOT_CPU"], "SPOT_CPU"),
    ],
)
def test_cpu_recipes_and_explicit_pools(overrides: list[str], resource: str | None) -> None:
    hw = load_recipe(RECIPES / "tiny.yaml", overrides).hardware
    assert hw.pool_resource == resource
    assert pool_request(hw) == ({resource: 1.0} if resource else {})


def test_a_gpu_recipe_can_run_on_any_gpu() -> None:
    assert load_recipe(RECIPES / "llama.yaml", ["hardware.pool=any"]).hardware.pool_resource is None


@pytest.mark.parametrize(
    ("pool", "words"),
    [
        ("GPU", "a resource Ray defines for every node"),
        ("memory", "a resource Ray defines for every node"),
        ("A100 80GB", "is not a Ray resource name"),
        ("_A100", "is not a Ray resource name"),
    ],
)
def test_a_pool_that_is_no_custom_resource_is_refused(pool: str, words: str) -> None:
    with pytest.raises(UserErrors) as info:
        load_recipe(RECIPES / "llama.yaml", [f"hardware.pool={pool}"])
    (error,) = info.value.errors
    assert error.field == "hardware.pool" and words in error.problem and error.value == pool


def test_a_local_run_provides_the_pool_for_every_worker(tmp_path: Path) -> None:
    # In a subprocess: the test session's own Ray is already initialised in this process.
    code = (
        "import ray\n"
        "from osdp_platform.driver.cluster import connect\n"
        "from osdp_platform.recipe.loader import load_recipe\n"
        f"recipe = load_recipe({str(RECIPES / 'tiny.yaml')!r}, ['hardware.pool=LOCAL_POOL', "
        "'hardware.workers_per_node=3'])\n"
        "connect(recipe, None)\n"
        "print('LOCAL_POOL', ray.cluster_resources().get('LOCAL_POOL'))\n"
        "ray.shutdown()\n"
    )
    assert "LOCAL_POOL 3.0" in _fresh_python(code, tmp_path)


def test_a_local_ray_is_sized_for_the_largest_cell_whatever_the_order(tmp_path: Path) -> None:
    """A sweep starts one local Ray for all its cells: a smaller cell first must not size it (1 worker,
    then 3, on a 2-core machine, was refused by check_cluster for the second cell)."""
    code = (
        "import ray\n"
        "from osdp_platform.driver.cluster import check_cluster, connect\n"
        "from osdp_platform.recipe.loader import load_recipe\n"
        f"cells = [load_recipe({str(RECIPES / 'tiny.yaml')!r}, ['hardware.pool=LOCAL_POOL', "
        "f'hardware.workers_per_node={n}']) for n in (1, 3)]\n"
        "connect(cells, None)\n"
        "for cell in cells:\n"
        "    check_cluster(cell)\n"
        "print('LOCAL_POOL', ray.cluster_resources().get('LOCAL_POOL'))\n"
        "ray.shutdown()\n"
    )
    assert "LOCAL_POOL 3.0" in _fresh_python(code, tmp_path)


def _fresh_python(code: str, folder: Path) -> str:
    """`code`'s output from a Python of its own (the test session's Ray is already initialised in this one)."""
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=180,
        env={"PATH": "/usr/bin:/bin", "HOME": str(folder), "RAY_USAGE_STATS_ENABLED": "0"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
