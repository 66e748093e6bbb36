"""``--otel``: a guarded program's own OpenTelemetry meter provider receives ``gen_ai.client.token.usage``
for each call, equal to what the ledger recorded; without it nothing is recorded; without the SDK, one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from quotawrap.simulator import ArkSimulator
from tests.conftest import cli_json, run_quotawrap

MODEL = "deepseek-v4-flash"
CALLS = 3

PROGRAM = """
import json, os, time

from opentelemetry import metrics
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

reader = InMemoryMetricReader()
metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

import openai

sdk = openai.OpenAI(base_url=os.environ["SIM_URL"], api_key="sk-test", max_retries=0)
for n in range(int(os.environ["CALLS"])):
    sdk.chat.completions.create(
        model=os.environ["MODEL"], messages=[{"role": "user", "content": f"hello {n}"}], max_tokens=100
    )


def points():
    data = reader.get_metrics_data()
    found = []
    for resource in (data.resource_metrics if data else []):
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                if metric.name == "gen_ai.client.token.usage":
                    found += [
                        {"attributes": dict(p.attributes), "sum": p.sum, "count": p.count, "unit": metric.unit}
                        for p in metric.data.data_points
                    ]
    return found


deadline = time.monotonic() + (30 if os.environ.get("EXPECT_POINTS") == "1" else 0)
found = points()
while sum(p["count"] for p in found) < 2 * int(os.environ["CALLS"]) and time.monotonic() < deadline:
    time.sleep(0.05)  # a settle may land on the settler's thread just after the call returns
    found = points()
print(json.dumps(found))
"""


def _run(sim: ArkSimulator, store: str, tmp_path: Path, *flags: str) -> list[dict[str, Any]]:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM, encoding="utf-8")
    env = {"SIM_URL": sim.url, "CALLS": str(CALLS), "MODEL": MODEL, "EXPECT_POINTS": "1" if flags else "0"}
    result = run_quotawrap(["--store", store, "--base-url", sim.url, *flags], [sys.executable, str(script)], env=env)
    assert result.returncode == 0, result.stderr
    points: list[dict[str, Any]] = json.loads(result.stdout.strip().splitlines()[-1])
    return points


def test_token_usage_histogram_equals_the_ledger(sim: ArkSimulator, store: str, tmp_path: Path) -> None:
    """Input and output tokens of every call, with the GenAI attributes, summing to the ledger's record."""
    sim.configure(reply_tokens=70)
    points = _run(sim, store, tmp_path, "--otel")
    by_type = {p["attributes"]["gen_ai.token.type"]: p for p in points}
    assert set(by_type) == {"input", "output"} and len(points) == 2
    (row,) = cli_json("report", "--store", store, "--by", "model", "--format", "json")["rows"]
    assert by_type["input"]["sum"] == row["prompt_tokens"] > 0
    assert by_type["output"]["sum"] == row["completion_tokens"] > 0
    assert by_type["input"]["sum"] + by_type["output"]["sum"] == sim.billed_total()
    for point in points:
        assert point["count"] == CALLS and point["unit"] == "{token}"
        assert point["attributes"]["gen_ai.request.model"] == MODEL
        assert point["attributes"]["gen_ai.operation.name"] == "chat"
        assert point["attributes"]["gen_ai.provider.name"] == point["attributes"]["gen_ai.system"] == "volcengine"


def test_off_by_default(sim: ArkSimulator, store: str, tmp_path: Path) -> None:
    """Without --otel the program's meter provider gets nothing from quotawrap."""
    assert _run(sim, store, tmp_path) == []
    assert sim.calls() == CALLS


def test_without_the_sdk_one_line_and_exit_2(tmp_path: Path) -> None:
    """--otel where the SDK cannot be imported: one line naming the cure, exit 2, the command never started."""
    marker = tmp_path / "started"
    argv = ["quotawrap", "--otel", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    code = (
        "import sys; sys.modules['opentelemetry.sdk'] = None\n"  # import machinery: this module cannot be found
        f"from quotawrap.cli import main\nsys.argv = {argv!r}\nmain()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "quotawrap: --otel: the OpenTelemetry SDK is not installed: pip install 'quotawrap[otel]'"
    ]
    assert not marker.exists()
