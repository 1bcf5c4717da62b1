"""Shared fixtures: tiny random-weight Llama models (with a character tokenizer) on disk."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import string

# Two workers share two cores (pytest-xdist, below): OpenMP threads that spin while they wait
# would take the core the other worker's threads need (a multi-threaded sweep ran 3x slower
# beside a busy core); passive waiting leaves it to them. Read once, when torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import triton_on_cpu  # noqa: E402,F401  (before anything imports Triton: its interpreter here)

# every runner's start check runs (tests make kernels fail it on purpose); its own tests cache
os.environ.setdefault("EDGESPEC_START_CHECK_CACHE", "none")
# Ray replaces 127.0.0.1 by the machine's interface address (even given --node-ip-address)
# unless multi-machine clusters are off; read when ray is imported, so set before any import.
# Every Ray node a test starts then has the loopback address: all traffic stays on 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
# a Ray token on this machine (~/.ray/auth_token, left by any Ray run outside the tests) turns
# the GCS of every cluster a test starts to token authentication: join such clusters in token mode
from edgespec_cli.deployment.cluster import use_token_auth_if_present  # noqa: E402

use_token_auth_if_present()
# a Ray head's GCS server on a loaded 2-core machine can take longer than Ray's 30 s to write its
# port file (a full suite's test_fleet head timed out so); every Ray start of the tests waits 120
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")
# The user's model cache, captured before tests isolate themselves from it.
REAL_CACHE = os.environ.get("EDGESPEC_CACHE_DIR")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# The developer's fast tier is ``pytest -m "not slow"`` (under 2 minutes on 2 cores: the engine,
# the drafters, the session protocol against both stores, the verification maths). A module
# that starts processes, servers, Ray or ssh, installs environments or runs long sweeps says so
# itself (``pytestmark = pytest.mark.slow``), and so does every test that loads the real default
# model (``real_model`` with ``slow``): a renamed module keeps its tier.


# The README's test command runs the suite on two pytest-xdist workers (`-n 2`): the suite waits
# on processes, servers and sockets for much of its time, so a second worker fills the idle core.
# Tests of different modules run at once (servers on free ports, Ray clusters included), and a
# module's fixtures may be built on both workers.


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: unknown to pytest without it
def pytest_xdist_make_scheduler(config, log):
    """Work stealing where the distribution is xdist's default (``load``, which hands tests out
    in small batches, so a module's fixture, a served model or a Ray cluster, often started on
    both workers): each worker takes half of the tests in order and then steals from the
    other's queue. Measured in docs/measured/cpu-kinds/README.md; ``--dist`` given otherwise
    is kept."""
    from xdist.scheduler import WorkStealingScheduling

    if config.getvalue("dist") == "load":
        return WorkStealingScheduling(config, log)
    return None


def hf_greedy(model, ids: list[int], n: int, eos=(2,)) -> list[int]:
    """Target-only greedy decoding with transformers' own generate(): the reference output."""
    eos = sorted(eos)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]),
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos[0])
    return out[0, len(ids):].tolist()


def hf_keyed_sampled(model, ids: list[int], n: int, params) -> list[int]:
    """Target-only keyed sampling with transformers' forward and edgespec's sampler, no engine:
    the reference output of a seeded sampled generation."""
    from reference import sample_at

    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(sample_at(model(torch.tensor([seq])).logits[0, -1], params, len(seq)))
    return seq[len(ids):]


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive loopback ports that nothing listens on now.

    Drawn below the kernel's ephemeral range (32768+, where outbound connections take their
    ports, as one took a replica's port in a CI run) and above Ray's worker ports (to 19999).
    """
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(20000, 32768 - n)
        try:
            with contextlib.ExitStack() as held:
                for port in range(base, base + n):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports in 20000-32767")


def make_tokenizer(extra: str = ""):
    """A character-level tokenizer: one id per printable character, plus specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    chars = sorted(set(string.printable) - set(string.whitespace) | {" "} | set(extra))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="<|end|>", pad_token="<|end|>")
    fast.add_special_tokens({"additional_special_tokens": specials[3:]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(path, seed: int = 0, layers: int = 4, vocab: int | None = None,
                    hidden: int = 64, tokenizer=None, init_range: float = 0.3,
                    looping: bool = False):
    """Save a random-weight Llama with peaked (large-init) distributions, so greedy argmax has
    clear winners. ``looping``: zero every attention and MLP output, so the next token is a
    fixed function of the last one and greedy output soon cycles (text MaG can draft)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tokenizer or make_tokenizer()
    vocab = vocab or len(tokenizer)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, initializer_range=init_range,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    if looping:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    model.generation_config.eos_token_id = 2
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-target"), seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1, layers=2)


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    from edgespec.models.loading import load_model

    return load_model(str(tiny_dir), dtype="float32")


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory):
    """A tiny random-weight SmolVLM/Idefics3 folder (tests/vlm_models.py)."""
    from vlm_models import make_tiny_vlm

    return make_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="session")
def vlm(vlm_dir):
    from edgespec.models.loading import load_model

    return load_model(str(vlm_dir), dtype="float32")


@pytest.fixture(autouse=True)
def _isolated_cache(request, tmp_path, monkeypatch):
    """Keep tests away from the user's model cache, except those marked ``real_model``."""
    if request.node.get_closest_marker("real_model"):
        if REAL_CACHE is None:
            monkeypatch.delenv("EDGESPEC_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("EDGESPEC_CACHE_DIR", REAL_CACHE)
    else:
        monkeypatch.setenv("EDGESPEC_CACHE_DIR", str(tmp_path / "edgespec-cache"))


@pytest.fixture(scope="session")
def external_redis():
    from redis_servers import ExternalRedis

    ext = ExternalRedis()
    yield ext.url
    ext.stop()


@pytest.fixture(scope="session", params=["embedded", "external"])
def redis_url(request):
    """A URL for each kind of real Redis: None means 'start the embedded one'."""
    if request.param == "embedded":
        return None
    return request.getfixturevalue("external_redis")


@pytest.fixture()
def verifier_parts(looping):
    """A verifier's parts in process over the embedded Redis, without a gRPC server: (store,
    engine, scheduler, admission), the scheduler not started (tests drive it)."""
    from cache_service.redis_conn import RedisHandle
    from cache_service.store import RedisSessionStore
    from edgespec.config import EngineConfig
    from edgespec.engine.spec_engine import SpecEngine
    from edgespec.models.loading import stop_token_ids
    from edgespec.runner.target_runner import TargetRunner
    from verifier_node.admission import Admission
    from verifier_node.scheduler import Scheduler

    handle = RedisHandle()
    store = RedisSessionStore(handle.client, ttl_s=60)
    runner = TargetRunner(looping.model, n_slots=2, max_len=256)
    engine = SpecEngine(runner, None, EngineConfig(max_sessions=2, max_context=256),
                        stop_token_ids(looping), store=store)
    sched = Scheduler(engine, max_queue=2)
    admission = Admission(sched, store, looping.tokenizer, runner.vocab_size)
    yield store, engine, sched, admission
    engine.close()
    store.shutdown()
    handle.close()


@pytest.fixture(scope="session")
def looping_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("looping-target"), seed=5, looping=True)


@pytest.fixture(scope="session")
def looping(looping_dir):
    from edgespec.models.loading import load_model

    return load_model(str(looping_dir), dtype="float32")


@pytest.fixture(scope="module")
def server(looping_dir, tmp_path_factory, request):
    """A live ``edgespec serve`` of the looping model with a MaG board, one a test module that
    asks for it (torch on one thread); a module that defines its own ``server`` uses that."""
    from http_harness import http_server

    with http_server(looping_dir, tmp_path_factory.mktemp(request.module.__name__.split(".")[-1]),
                     extra=("--threads", 1)) as s:
        yield s


@pytest.fixture(scope="module")
def api(server):
    """The official ``openai`` client of ``server``."""
    from http_harness import openai_client

    return openai_client(server)


# -- TLS tests' certificates: a CA, a server's (127.0.0.1) and a client's it signed, a rogue's
def _openssl(*args):
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates (apt-get install openssl)")
    d = tmp_path_factory.mktemp("mtls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    # a CA as Python 3.13's strict verification (``ssl.create_default_context`` sets
    # VERIFY_X509_STRICT) wants it: a key usage, critical basic constraints; the leaves name
    # their issuer's key (without these a 3.13 client refuses the server: "CA cert does not
    # include key usage extension"). Self-signed from a request with exactly these extensions:
    # ``req -x509`` adds its config's too, and OpenSSL 1.1.1's ``-addext`` then doubles one
    (d / "ca.ext").write_text("basicConstraints=critical,CA:TRUE\n"
                              "keyUsage=critical,keyCertSign,cRLSign\nsubjectKeyIdentifier=hash\n")
    _openssl("req", *ec, "-subj", "/CN=edgespec-test-ca", "-keyout", d / "ca.key",
             "-out", d / "ca.csr")
    _openssl("x509", "-req", "-in", d / "ca.csr", "-signkey", d / "ca.key", "-days", "1",
             "-extfile", d / "ca.ext", "-out", d / "ca.pem")
    leaf = "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
    (d / "server.ext").write_text(
        f"{leaf}subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text(f"{leaf}extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        _openssl("req", *ec, "-subj", f"/CN={who}", "-keyout", d / f"{who}.key",
                 "-out", d / f"{who}.csr")
        _openssl("x509", "-req", "-in", d / f"{who}.csr", "-CA", d / "ca.pem", "-CAkey",
                 d / "ca.key", "-CAcreateserial", "-days", "1", "-extfile", d / f"{who}.ext",
                 "-out", d / f"{who}.pem")
    _openssl("req", "-x509", *ec, "-days", "1", "-subj", "/CN=rogue",
             "-keyout", d / "rogue.key", "-out", d / "rogue.pem")
    return d


@pytest.fixture()
def fresh_probes():
    """The probes' verdicts (the attention kernel's, the linear products', the row spans') are
    cached per dtype, device and thread count: a test that breaks a kernel before a start check
    probes it (or whose verdict must be its own) starts and ends without them, so that a failure
    it causes on purpose is not the verdict of the tests after it (a cached failure once made
    float32 inexact for the rest of a worker)."""
    from edgespec.runner import dtype_probe

    caches = (dtype_probe._attention_kernel, dtype_probe._packed_linear_exact,
              dtype_probe._span_exact)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()
