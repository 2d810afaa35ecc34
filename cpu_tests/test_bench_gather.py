"""`kvxfer bench gather` (`kvxfer.bench.gather.run`): small runs on both backends report every
figure, and `pinned_in_place` says which path P's gather into pinned staging took."""

import pytest

from kvxfer.bench import gather
from kvxfer.errors import InvalidInputError


@pytest.mark.parametrize("mesh_shape", [(1, 4), (1, 1)], ids=["tp4", "one-device"])
def test_a_small_run_reports_every_figure_and_the_pinned_path_it_took(backend, mesh_shape):
    out = gather.run(layers=2, num_blocks=64, block_shape=(16, 4, 2, 32), count=16,
                     mesh_shape=mesh_shape, iters=2, recompile_trials=3)
    for key in ("gather_gbps", "memcpy_gbps", "gather_into_gbps", "device_put_gbps",
                "pinned_gbps", "pinned_over_device_put", "pinned_over_gather_into"):
        assert out[key] > 0, (key, out)
    assert out["bytes"] == 2 * 16 * 16 * 4 * 2 * 32 * 2 and out["devices"] == mesh_shape[1]
    assert out["recompiles_after_warmup"] == 0
    # In place only where the XLA backend writes: the numpy backend copies into the views.
    assert out["pinned_in_place"] is (backend == "xla")


def test_a_mesh_the_devices_cannot_make_is_refused_by_name():
    with pytest.raises(InvalidInputError, match=r"mesh_shape must be .* got \(1, 3\)"):
        gather.run(layers=1, num_blocks=8, block_shape=(16, 4, 2, 32), count=4, mesh_shape=(1, 3))
