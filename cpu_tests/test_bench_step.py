"""`kvxfer bench step`: the engine step's cost, idle and with 8 requests in flight."""

from kvxfer.bench import step


def test_bench_step_reports_idle_and_busy_steps_by_layer_count_with_8_reads_in_flight():
    got = step.run(layer_counts=(2, 4), steps=20, rounds=1)
    for key in ("idle_step_us", "busy_step_us"):
        assert set(got[key]) == {"2", "4"} and all(v > 0 for v in got[key].values())
    assert got["in_flight"] == {"2": 8, "4": 8} and got["ok"] is True
    assert set(got["busy_calls_us"]["4"]) == {"build_connector_meta", "wait_for_save",
                                              "p_get_finished", "start_load_kv", "d_get_finished"}
    assert set(got["layers_4_over_2"]) == {"idle", "busy"}
