"""A vision-language target end to end: `edgespec serve --model` of a tiny random-weight SmolVLM
(Idefics3) folder with a MaG board drafting (it drafts on the session's token ids: no image),
asked through the HTTP API with the official `openai` client (images as `data:` URLs in
`image_url` parts) and through the SDK over gRPC. The output is the VLM's own, greedy and keyed
sampled; bad images are refused with a 400 (HTTP) or INVALID_ARGUMENT (gRPC) that says why."""

from __future__ import annotations

import base64

import openai
import pytest

import edgespec
from vlm_models import png, vlm_greedy, vlm_keyed

from edgespec.config import SamplingParams
from edgespec.models.images import MAX_IMAGE_BYTES, decode_images
from edgespec.wire.channels import free_port
from procs import start_drafter, start_serve

pytestmark = pytest.mark.slow  # processes and servers: not the fast tier

TOKEN = "v1s10n"
N = 24



@pytest.fixture(scope="module")
def server(vlm_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm-serve")
    http_port = free_port()
    serve, address = start_serve(vlm_dir, tmp, token=TOKEN, extra=[
        "--http-port", http_port, "--draft-wait-ms", 5000, "--no-adaptive"])
    board = start_drafter(address, "board-1", tmp, "mag", token=TOKEN)
    board.wait_for("attached to")
    yield {"address": address, "base": f"http://127.0.0.1:{http_port}"}
    assert (board.stop(), serve.stop()) == (0, 0)


@pytest.fixture(scope="module")
def api(server):
    client = openai.OpenAI(base_url=server["base"] + "/v1", api_key=TOKEN, max_retries=0,
                           timeout=120)
    client.model_id = client.models.list().data[0].id
    return client


@pytest.fixture(scope="module")
def sdk(server):
    with edgespec.Client(server["address"], token=TOKEN, timeout=120) as client:
        yield client


def data_url(image: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(image).decode()}"


def expected(vlm, text: str, images: list[bytes], n: int = N) -> tuple[list[int], list[int]]:
    """(prompt ids, the VLM's own greedy output) for one user message with its images."""
    ids, pictures = vlm.vision.encode(text, images=decode_images(images))
    return ids, vlm_greedy(vlm.vision, ids, pictures, n)


def test_an_image_chat_over_http_is_the_vlms_own_output(api, vlm):
    image = png(21)
    ids, want = expected(vlm, "<image>what is this?", [image])
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image), "detail": "auto"}},
        {"type": "text", "text": "what is this?"}]}]
    r = api.chat.completions.create(model=api.model_id, messages=messages, max_tokens=N,
                                    temperature=0)
    text = vlm.tokenizer.decode(want, skip_special_tokens=True)
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    stats = r.model_extra["edgespec"]
    # the board drafted on the session's token ids (the verifier waited for every draft)
    assert stats["device"] == "board-1" and stats["lossless"] is True
    assert stats["drafted"] > 0 and 0 <= stats["accepted"] <= stats["drafted"]
    # streamed: the same text; an image between two texts goes where it stands
    chunks = api.chat.completions.create(model=api.model_id, messages=messages, max_tokens=N,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    jpeg = png(22, (50, 30), fmt="JPEG")
    _, want = expected(vlm, "left <image> right", [jpeg])
    r = api.chat.completions.create(model=api.model_id, max_tokens=N, temperature=0, messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "left "},
            {"type": "image_url", "image_url": {"url": data_url(jpeg, "image/jpeg")}},
            {"type": "text", "text": " right"}]}])
    assert r.choices[0].message.content == vlm.tokenizer.decode(want, skip_special_tokens=True)


def test_sdk_images_give_the_vlms_own_greedy_and_sampled_output(sdk, vlm, tmp_path):
    image = png(23, (32, 48))
    path = tmp_path / "picture.png"
    path.write_bytes(image)
    ids, want = expected(vlm, "describe", [image])
    for given in (image, str(path)):
        out = sdk.generate("describe", images=[given], max_new_tokens=N)
        assert out.token_ids == want and out.prompt_tokens == len(ids)
        assert out.device_id == "board-1"
    params = SamplingParams(temperature=0.9, top_k=30, seed=5)
    _, pictures = vlm.vision.encode("describe", images=decode_images([image]))
    want = vlm_keyed(vlm.vision, ids, pictures, N, params)
    out = sdk.generate("describe", images=[image], max_new_tokens=N, temperature=0.9,
                       top_k=30, seed=5)
    assert out.token_ids == want


def _refusal(api, content, match: str) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError, match=match) as err:
        api.chat.completions.create(model=api.model_id, max_tokens=4,
                                    messages=[{"role": "user", "content": content}])
    return err.value


def _image_part(url: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]


def test_bad_images_over_http_are_refused_with_the_reason(api):
    err = _refusal(api, _image_part("https://example.com/cat.png"),
                   "remote image URLs are refused .*data:image/png;base64")
    assert err.body["code"] == "image_url_not_inline"
    assert err.body["param"] == "messages.[0].content.[0].image_url.url"
    _refusal(api, _image_part("data:image/png;base64,@@not base64@@"), "not valid base64")
    _refusal(api, _image_part("data:text/plain;base64,aGk="), "not an image")
    _refusal(api, _image_part(data_url(b"hello, no image here")),
             "image 0 cannot be decoded: it is not an image")
    _refusal(api, _image_part(data_url(png(1, (64, 64))[:150])), "truncated or corrupt")
    _refusal(api, _image_part(data_url(_solid(5000, 4000))), "5000x4000 pixels: at most")
    _refusal(api, _image_part(data_url(b"\x89PNG" + bytes(MAX_IMAGE_BYTES))),
             f"images are {MAX_IMAGE_BYTES + 4} bytes together: a request takes at most")
    _refusal(api, _image_part(data_url(bytes(MAX_IMAGE_BYTES + 8))),
             f"over {MAX_IMAGE_BYTES} bytes")  # refused before its base64 is decoded
    _refusal(api, [{"type": "input_audio", "input_audio": {}}], "text and image_url")
    _refusal(api, "<image> twice <image>", "2 <image> mark.* but 0 image")


def _solid(width: int, height: int) -> bytes:
    """One colour, as PNG: a few kilobytes however many pixels."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (20, 90, 200)).save(buf, format="PNG")
    return buf.getvalue()


def test_bad_images_over_grpc_are_refused_with_the_reason(sdk):
    with pytest.raises(edgespec.InvalidRequest, match="image 0 cannot be decoded"):
        sdk.generate("hi", images=[b"not an image"], max_new_tokens=4)
    with pytest.raises(edgespec.InvalidRequest, match="5000x4000 pixels"):
        sdk.generate("hi", images=[_solid(5000, 4000)], max_new_tokens=4)
    with pytest.raises(edgespec.InvalidRequest, match="at most 8"):  # refused by the SDK
        sdk.generate("hi", images=[png(1)] * 9, max_new_tokens=4)
    with pytest.raises(edgespec.InvalidRequest, match="not token ids"):
        sdk.generate(prompt_ids=[5, 6], images=[png(1)], max_new_tokens=4)


def test_a_text_only_verifier_refuses_images(verifier_parts):
    """The admission both front doors share: a text-only target refuses a request's images
    before any work (INVALID_ARGUMENT over gRPC, 400 over HTTP)."""
    from edgespec.models.images import ImageRefused
    from verifier_node.admission import GenerationRequest

    _, _, _, admission = verifier_parts
    with pytest.raises(ImageRefused, match="text-only: it takes no images"):
        admission.admit(GenerationRequest(prompt="describe", images=[png(1)]))


def test_generate_image_on_the_command_line(vlm_dir, vlm, tmp_path, tiny_dir):
    """`edgespec generate --image PATH` (repeatable): the VLM's own output; a text-only model,
    an unreadable path and a file that is no image are one line and status 2."""
    import json

    from cli_inprocess import run_cli as edgespec  # in this process: main(argv) and its status

    first, second = tmp_path / "a.png", tmp_path / "b.jpg"
    first.write_bytes(png(31))
    second.write_bytes(png(32, fmt="JPEG"))
    ids, pictures = vlm.vision.encode("<image> vs <image>",
                                      images=decode_images([png(31), png(32, fmt="JPEG")]))
    want = vlm_greedy(vlm.vision, ids, pictures, N)
    r = edgespec("generate", "<image> vs <image>", "--model", vlm_dir, "--image", first,
                 "--image", second, "--max-new-tokens", N, "--json", "--dtype", "float32",
                 "--threads", 1)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == want and out["prompt_tokens"] == len(ids)
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"no image")
    for model, image, message in ((tiny_dir, first, "text-only: it takes no images"),
                                  (vlm_dir, tmp_path / "missing.png", "cannot read the image"),
                                  (vlm_dir, bad, "image 0 cannot be decoded")):
        r = edgespec("generate", "hi", "--model", model, "--image", image, "--dtype", "float32",
                     "--threads", 1)
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_an_image_session_lost_by_its_verifier_is_recreated_with_its_images(vlm):
    """The cache keeps a session's token ids, not its images: a resume of an image session that
    runs on no verifier is answered as a lost session (NOT_FOUND over gRPC), and the SDK's
    re-creation (the request again, its images included, with the tokens received) goes on as
    the VLM alone would."""
    from cache_service.redis_conn import RedisHandle
    from cache_service.store import RedisSessionStore
    from edgespec.config import EngineConfig
    from edgespec.engine.spec_engine import SpecEngine
    from edgespec.models.loading import stop_token_ids
    from edgespec.runner.target_runner import TargetRunner
    from verifier_node.admission import Admission, GenerationRequest, SessionNotFound
    from verifier_node.scheduler import Scheduler

    image = png(41)
    _, want = expected(vlm, "describe", [image], 12)
    handle = RedisHandle()
    store = RedisSessionStore(handle.client, ttl_s=60)
    try:
        runner = TargetRunner(vlm.model, n_slots=2, max_len=256)
        engine = SpecEngine(runner, None, EngineConfig(max_sessions=2, max_context=256),
                            stop_token_ids(vlm), store=store, vision=vlm.vision)
        sched = Scheduler(engine, max_queue=2)
        admission = Admission(sched, store, vlm.tokenizer, runner.vocab_size)
        ticket = admission.admit(GenerationRequest(prompt="describe", images=[image],
                                                   max_new_tokens=12))
        sched._admit()
        for _ in range(3):
            engine.step()
        got = list(ticket.tokens)
        assert 0 < len(got) < 12 and got == want[:len(got)]
        engine.abandon(engine.active[0], RuntimeError("the verifier stopped"))
        with pytest.raises(SessionNotFound, match="has images, which the cache does not keep"):
            admission.admit(GenerationRequest(resume_session_id=ticket.session_id))
        again = admission.admit(GenerationRequest(
            prompt="describe", images=[image], max_new_tokens=12, committed=got,
            lost_session_id=ticket.session_id))
        sched._admit()
        while engine.sessions:
            engine.step()
        assert again.result is not None and again.result.token_ids == want
    finally:
        store.shutdown()
        handle.close()
