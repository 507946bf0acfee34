"""The reproducible lane, end to end: a request with `strata_reproducible: "required"`
returns exactly what it returns alone on an idle server, whatever runs beside it.

The trials are `bench.repro.check` (the same check runs on the GPU): token ids (vLLM's
`return_tokens_as_token_ids`), text and logprobs, chosen and top, compared exactly. The
control: the same requests in the fast lane, under the same backgrounds, do change — which
shows the lane does the work and that the comparison can fail.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai import OpenAI

from api.pipeline.lanes import FAST, REPRODUCIBLE, LaneOptions, resolve_lane
from api.server.errors import NotReproducible, ReproducibleLaneUnavailable
from bench.repro import check
from bench.server_proc import Server, start_server
from tests.conftest import MODEL
from tests.test_api_e2e import metrics

pytestmark = pytest.mark.e2e
TRIALS = 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The server's own defaults for the lanes; a fast lane wide enough for 10 streams."""
    log = tmp_path_factory.mktemp("repro") / "server.log"
    srv = start_server(["--n-ctx", "8192", "--n-seq-max", "12"], log)
    yield srv
    srv.stop()


def test_reproducible_requests_match_alone_under_random_load(server: Server) -> None:
    before = metrics(server)
    same, reference, backgrounds = check(server, MODEL, TRIALS)
    assert reference["greedy/reproducible"] == reference["greedy/fast"]  # alone, both solo
    # The lane: identical every time, greedy and seeded sampling alike.
    assert same["greedy/reproducible"] == TRIALS
    assert same["sampled/reproducible"] == TRIALS
    # The control: the fast lane under the same backgrounds is not bit-identical to alone.
    assert same["greedy/fast"] < TRIALS
    assert same["sampled/fast"] < TRIALS
    # Each lane counted its requests (the backgrounds are fast-lane requests too).
    after = metrics(server)
    key = "onegpu_lane_requests_total{lane=%s}"
    counted = {ln: after[key % ln] - before.get(key % ln, 0.0) for ln in (REPRODUCIBLE, FAST)}
    assert counted == {REPRODUCIBLE: 2 * (TRIALS + 1), FAST: 2 * (TRIALS + 1) + backgrounds}


def test_lane_refusals_name_the_problem(server: Server) -> None:
    c = OpenAI(base_url=server.base_url, api_key="none", _strict_response_validation=True)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="hi", extra_body={"strata_reproducible": "yes"})
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "strata_reproducible"
    assert "'required'" in err["message"] and "'off'" in err["message"]
    # Sampling without a seed cannot be reproduced: refused, not served in the fast lane.
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0.7,
            extra_body={"strata_reproducible": "required"},
        )  # fmt: skip
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "seed"
    # Longer than the lane's own KV stream (4,096 tokens by default).
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(
            model=MODEL, prompt=[1000] * 4000, max_tokens=200, temperature=0,
            extra_body={"strata_reproducible": "required"},
        )  # fmt: skip
    assert isinstance(e.value.body, dict) and e.value.body["code"] == "context_length_exceeded"
    # "off" is the server default (the fast lane here), named in the fingerprint.
    r = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"strata_reproducible": "off"},
    )  # fmt: skip
    assert r.system_fingerprint is not None and r.system_fingerprint.endswith("-fast")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_lane_choice_follows_the_server_mode() -> None:
    fork, gpu = LaneOptions(), LaneOptions(cpu_numerics="gpu")
    assert resolve_lane(None, fork) == FAST
    assert resolve_lane("off", fork) == FAST
    assert resolve_lane("required", fork) == REPRODUCIBLE
    assert resolve_lane(None, gpu) == REPRODUCIBLE  # --cpu-numerics gpu: everyone
    assert resolve_lane("off", gpu) == REPRODUCIBLE
    with pytest.raises(ReproducibleLaneUnavailable):
        resolve_lane("required", LaneOptions(slots=0))
    assert resolve_lane(None, LaneOptions(slots=0)) == FAST
    with pytest.raises(NotReproducible.__mro__[1]):  # InvalidRequest: any other value
        resolve_lane("sometimes", fork)
