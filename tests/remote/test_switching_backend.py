"""SwitchingBackend: the window's one backend, local or a server, switched in place. Both sides are
real EngineClients over RemoteEngines talking to two real (stub) servers, so every answer says
where it came from."""

from __future__ import annotations

import asyncio
import threading
import time

from ds4desk.engine.api import FinishReason, GenerateRequest, LoadRequest
from ds4desk.engine.client import EngineClient
from ds4desk.remote import NOT_AVAILABLE, RemoteConfig, RemoteEngine, is_remote
from ds4desk.remote.switch import SwitchingBackend
from tests.remote.stub import Handler, Respond, content, stub_server

MESSAGES = [{"role": "user", "content": "Hi"}]


def answering(name: str, slow: threading.Event | None = None) -> Respond:
    def script(h: Handler) -> None:
        h.start_events()
        if slow is not None:
            for _ in range(1500):
                h.event(content(f"{name} "))
                slow.set()
                time.sleep(0.02)
        h.event(content(f"from {name}", finish="stop"))
        h.event(b"[DONE]")

    return script


def test_answers_come_from_the_current_side_and_stop_reaches_the_side_it_started_on() -> None:
    local_streaming = threading.Event()
    with (
        stub_server(answering("local", local_streaming), models=["here"]) as local_stub,
        stub_server(answering("server"), models=["there"]) as remote_stub,
    ):

        async def run() -> None:
            local_engine = RemoteEngine(RemoteConfig(local_stub.url))
            switch = SwitchingBackend(EngineClient(local_engine), EngineClient)  # type: ignore[arg-type]
            try:
                assert (await switch.load(LoadRequest())).ok and switch.model_info.name == "here"  # type: ignore[union-attr]
                slow = GenerateRequest(messages=MESSAGES, max_new_tokens=2000)
                answer = asyncio.ensure_future(switch.generate(slow))
                await asyncio.get_running_loop().run_in_executor(None, local_streaming.wait, 30)

                server = RemoteEngine(RemoteConfig(remote_stub.url))
                assert server.load().ok
                switch.use_remote(server)
                assert switch.remote and is_remote(switch.model_info)
                assert switch.model_info.name == "there"  # type: ignore[union-attr]
                quick = await switch.generate(GenerateRequest(messages=MESSAGES, max_new_tokens=8))
                assert quick.text == "from server"

                switch.cancel(slow.request_id)  # reaches the local side, where it started
                stopped = await answer
                assert stopped.finish_reason == FinishReason.CANCELLED and stopped.text.startswith("local ")

                parked = await switch.park("all")
                assert parked.error is not None and NOT_AVAILABLE in parked.error.detail

                # Opening a local model leaves the server.
                assert (await switch.load(LoadRequest())).ok
                assert not switch.remote and switch.model_info.name == "here"  # type: ignore[union-attr]
                server._thread.join(10)
                assert not server._thread.is_alive()
            finally:
                switch.close()

        asyncio.run(run())
    assert [s.method for s in remote_stub.seen].count("POST") == 1
    assert [s.method for s in local_stub.seen].count("POST") == 1
