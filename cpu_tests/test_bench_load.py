"""`kvxfer bench serve --load`'s arithmetic: what it reads off the engines' `/metrics` around
a load point (the run itself needs `.venv-tpu` and minutes: `kvxfer bench serve --load`)."""

import http.server
import threading

import pytest

from kvxfer.bench import load
from kvxfer.cli import main

METRICS = """# HELP vllm:kvxfer_num_transfers_total transfers
# TYPE vllm:kvxfer_num_transfers_total counter
vllm:kvxfer_num_transfers_total{engine="0",model_name="tiny",role="D"} 6.0
vllm:kvxfer_num_fallbacks_total{engine="0",reason="no_params",p_engine="none"} 1.0
vllm:kvxfer_num_fallbacks_total{engine="0",reason="load_failed",p_engine="p"} 1.0
vllm:kvxfer_kv_wait_time_seconds_sum{engine="0",role="D"} 0.6
vllm:kvxfer_kv_wait_time_seconds_count{engine="0",role="D"} 6.0
vllm:request_queue_time_seconds_sum{engine="0"} 0.9
vllm:request_queue_time_seconds_count{engine="0"} 6.0
vllm:request_prefill_time_seconds_sum{engine="0"} 0.12
vllm:request_prefill_time_seconds_count{engine="0"} 6.0
"""


@pytest.fixture
def d_url():
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = METRICS.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_load_points_kv_moved_and_breakdown_come_from_the_metrics_deltas(d_url):
    after = load.scrape({"D": d_url, "P": None})
    assert after[("D", "vllm:kvxfer_num_fallbacks_total")] == 2.0  # label sets summed
    before = {("D", "vllm:kvxfer_num_transfers_total"): 2.0,
              ("D", "vllm:kvxfer_kv_wait_time_seconds_sum"): 0.2,
              ("D", "vllm:kvxfer_kv_wait_time_seconds_count"): 2.0,
              ("D", "vllm:request_queue_time_seconds_sum"): 0.3,
              ("D", "vllm:request_queue_time_seconds_count"): 2.0}
    out = load.deltas(before, after, completed=5)
    assert out["kv_moved"] == 0.8  # 4 loads for 5 requests: one was computed on D
    assert out["fallbacks"] == 2
    b = out["breakdown_ms"]
    assert b["d_kv_wait"] == 100.0 and b["d_queue"] == 150.0 and b["d_first_step"] == 20.0
    assert b["d_handover"] == 70.0  # queued outside the KV wait, plus the first step
    assert b["p_queue"] is None  # P's metrics were not scraped


def test_a_stack_without_kvxfers_counters_says_kv_moved_is_unknown():
    assert load.deltas({}, {("D", "vllm:num_requests_running"): 1.0}, 4) == {"kv_moved": None}


def test_kv_moved_counts_each_request_once_over_ds_workers():
    # D over two hosts: each worker counts a transfer once it read its piece of the KV.
    before = {("D", "vllm:kvxfer_num_transfers_total"): 0.0}
    after = {("D", "vllm:kvxfer_num_transfers_total"): 6.0}
    assert load.deltas(before, after, completed=3, d_workers=2)["kv_moved"] == 1.0
    assert load.deltas(before, after, completed=4, d_workers=2)["kv_moved"] == 0.75


def test_load_and_hosts_are_refused_by_name_for_other_benchmarks(capsys):
    assert main(["bench", "ttft", "--load"]) == 2
    assert "--load and --hosts are options of `kvxfer bench serve`" in capsys.readouterr().err
    assert main(["bench", "e2e", "--hosts", "2"]) == 2
    assert "--load and --hosts are options of `kvxfer bench serve`" in capsys.readouterr().err


@pytest.mark.parametrize("hosts", [0, 3, -1])
def test_a_host_count_other_than_one_or_two_is_refused_naming_it(hosts, capsys):
    assert main(["bench", "serve", "--hosts", str(hosts)]) == 2
    assert "--hosts takes 1" in (err := capsys.readouterr().err) and f"got {hosts}" in err


def test_a_stack_without_kvxfer_still_gets_vllms_own_queue_and_prefill_times():
    # tpu-inference's connector, or one colocated instance: P's and D's vLLM histograms only.
    after = {("P", "vllm:request_prefill_time_seconds_sum"): 3.0,
             ("P", "vllm:request_prefill_time_seconds_count"): 4.0,
             ("D", "vllm:request_queue_time_seconds_sum"): 0.4,
             ("D", "vllm:request_queue_time_seconds_count"): 4.0}
    out = load.deltas({}, after, completed=4)
    assert out["kv_moved"] is None
    b = out["breakdown_ms"]
    assert b["p_prefill"] == 750.0 and b["d_queue"] == 100.0
    assert b["d_kv_wait"] is None and b["d_handover"] is None  # kvxfer's own: unknown here


def test_the_clients_output_ends_in_a_newline_so_the_progress_line_starts_its_own(
        tmp_path, monkeypatch, capsys):
    """vllm bench serve's last words (nanobind's leak warning at exit) end without a newline;
    its output is passed on as it comes."""
    import json
    import sys

    out = tmp_path / "point.json"
    out.write_text(json.dumps({"completed": 4, "failed": 0, "median_ttft_ms": 12.5}))
    script = "import sys; sys.stdout.write('Starting...\\n'); sys.stderr.write('See nanobind')"
    real = load._relay  # the client run is a stand-in that writes what vllm's ends with
    monkeypatch.setattr(load, "_relay", lambda argv, env, timeout_s: real(
        [sys.executable, "-c", script], {}, timeout_s))
    point = load._client("http://127.0.0.1:1", tmp_path, 256, 1, out, seed=1)
    assert point["completed"] == 4 and point["median_ttft_ms"] == 12.5
    assert capsys.readouterr().err == "Starting...\nSee nanobind\n"


def test_a_client_that_outlives_its_time_is_killed_and_its_status_says_so(capsys):
    import sys

    status = load._relay([sys.executable, "-c", "import time; print('up', flush=True); "
                          "time.sleep(30)"], {}, timeout_s=1.0)
    assert status != 0 and capsys.readouterr().err == "up\n"
