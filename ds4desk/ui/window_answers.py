"""The window's answers: Send and Stop, storing the question, streaming the answer into the history
and the view, and what the status bar and the docks show when it ends. MainWindow inherits it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ds4desk.engine.api import (
    EngineError,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    SaveSnapshot,
    TextDelta,
    ThinkingFormat,
)
from ds4desk.history import LEAF
from ds4desk.remote import is_remote
from ds4desk.ui.banners import NO_MODEL_HELP, NO_MODEL_TITLE
from ds4desk.ui.chat_view import NoteKind, counts_as_thinking
from ds4desk.ui.conversation import Generation, conversation, message_note
from ds4desk.ui.markdown_render import split_thinking
from ds4desk.ui.markdown_render import with_think_tag as _with_think_tag
from ds4desk.ui.stats_format import status_speed

log = logging.getLogger(__name__)

SEND_HELP = "Send (Enter or Ctrl+Enter)"
EMPTY_CHAT = "Ask anything. Answers stream in here."
# One short line: QTextBrowser draws its placeholder unwrapped; the bar above says the rest.
NO_MODEL_CHAT = "No model is loaded: load one with the buttons above."


class Answering:
    """MainWindow's sending and streaming; the widgets and state it reads are MainWindow's."""

    @property
    def busy(self) -> bool:
        return self._send_task is not None and not self._send_task.done()

    def submit(self) -> None:
        """Enter or Send: take the composer's text and answer it in the background."""
        text = self.composer.text().strip()
        if not text:
            return
        if not self.can_send:
            self.set_status(f"{NO_MODEL_TITLE} {NO_MODEL_HELP}", error=True)
            return  # the text stays in the composer
        if self.busy:
            self.set_status("Still answering: press Stop (Esc) to interrupt it first.")
            return  # the text stays in the composer
        parent: int | str | None = LEAF
        edited = self.history.get_message(self.composer.finish_edit() or 0)
        if edited is not None and edited.chat_id == self.current_chat_id:
            parent = edited.parent_id  # the edit becomes a sibling: a new branch, the old one stays
        self.composer.clear()
        self._set_busy(True)  # now, not when the task first runs: a second Enter must see it
        self._send_task = asyncio.ensure_future(self.send_message(text, parent_id=parent))

    def stop(self) -> None:
        if self._generation is not None:
            self.backend.cancel(self._generation.request_id)
            self.set_status("Stopping…")
        elif self.composer.editing is not None:
            self.composer.cancel_edit()
            self.set_status("Edit cancelled.")

    async def send_message(
        self, text: str | None, *, parent_id: int | str | None = LEAF
    ) -> GenerateResult | None:
        """Store and show the user's message, then stream the answer into history and the view.
        `parent_id`: where the message goes (LEAF: after the last one; else a new branch). With
        `text` None (regenerate) only a new answer is written, under `parent_id`."""
        self._set_busy(True)
        try:
            return await self._answer(text, parent_id)
        finally:
            self._generation = None
            if not self._closed:
                self._set_busy(False)

    async def _answer(self, text: str | None, parent_id: int | str | None) -> GenerateResult | None:
        chat_id = self.current_chat_id
        if chat_id is None or self.history.get_chat(chat_id) is None:
            if text is None:
                return None  # nothing to regenerate
            info = self.backend.model_info
            chat_id = self.history.create_chat(model=info.name if info else None).id
            self.current_chat_id = chat_id
            parent_id = LEAF
        branching = parent_id != LEAF
        answer_parent: int | str | None = LEAF
        if text is not None:
            user = self.history.add_message(chat_id, "user", text, parent_id=parent_id)
            if not branching:
                self.chat_view.add_message("user", text, message_id=user.id)
            else:
                self.open_chat(chat_id)  # the new branch, with its "< 2/2 >" switcher
        else:
            answer_parent = parent_id  # regenerate: a sibling of the old answer
        self._refresh_sidebar()
        # Let the loop draw the question before the answer's frame is made: two short steps rather
        # than one long one (in a long chat each new frame costs a relayout of the whole chat).
        await asyncio.sleep(0)
        if self._closed:
            return None

        # The engine keeps the current model answering while the next one loads: only wait without one.
        load = self.model_loader.task
        if load is not None and not load.done() and self.backend.model_info is None:
            self.set_status("Waiting for the model to finish loading…")
            await asyncio.wait([load])
            if self._closed:
                return None

        # Think only where the chat format has a thinking mode; the answer is shown as thinking only
        # from the model's own <think>, or from the one the prompt opened.
        info = self.backend.model_info
        chat_format = info.thinking if info is not None else ThinkingFormat()
        thinking = self.settings.thinking and chat_format.switch
        until = answer_parent if text is None else None  # regenerate: the question, not the old answer
        speculative, speculative_note = self._speculative_for(info)
        request = GenerateRequest(
            messages=conversation(self.history, chat_id, self.settings.system_prompt, until=until),
            sampling=self.settings.sampling(),
            max_new_tokens=self.settings.max_new_tokens,
            thinking=thinking,
            thinking_budget=self.settings.thinking_budget() if thinking else None,
            speculative=speculative,
            # The next turn's prompt starts with this one and its answer: keep the state there, so
            # a follow-up prefills only the new message.
            save_snapshot=SaveSnapshot(tag=str(chat_id)),  # the slot panel shows whose it is
        )
        row = self.history.add_message(chat_id, "assistant", "", parent_id=answer_parent, finished=False)
        generation = Generation(chat_id, request.request_id, self.history.streaming_writer(row.id))
        generation.think_tag_pending = chat_format.opened(thinking)
        self._generation = generation
        if self.current_chat_id == chat_id:
            if text is None:
                self.open_chat(chat_id)  # shows the new, still empty answer with its switcher
            else:
                self.chat_view.begin_stream(message_id=row.id)
        self.set_status("Answering…" + speculative_note)
        self.perf_panel.begin_answer()
        self.park_readout.stop()  # the engine does not count idle time while it answers

        def on_delta(delta: TextDelta) -> None:
            if self._closed:
                return
            self.perf_panel.on_delta(delta)
            text = delta.text
            if generation.think_tag_pending and text:
                generation.think_tag_pending = False
                text = _with_think_tag(text)
            before = generation.writer.text
            if counts_as_thinking(before, text):
                generation.thinking_tokens += len(delta.tokens)
            generation.writer.append(text)
            if self.current_chat_id == chat_id:
                self.chat_view.append_stream(text, len(delta.tokens))

        try:
            result = await self.backend.generate(request, on_delta)
        except Exception as exc:  # the backend promises not to raise; a bug must not wedge the window
            log.exception("generate raised")
            result = GenerateResult(
                request_id=request.request_id,
                error=EngineError(ErrorCode.DECODE_FAILED, f"{type(exc).__name__}: {exc}"),
            )
        if self._closed:
            return result  # closeEvent already saved what had streamed
        self._finish(generation, result)
        return result

    def _finish(self, generation: Generation, result: GenerateResult) -> None:
        cancelled = result.finish_reason == FinishReason.CANCELLED or (
            result.error is not None and result.error.code == ErrorCode.CANCELLED
        )
        if cancelled:
            reason = FinishReason.CANCELLED
        elif result.error is not None:
            reason = FinishReason.ERROR
        else:
            reason = result.finish_reason
        stats: dict[str, Any] = {"finish_reason": str(reason), **result.stats.to_json()}
        if result.error is not None and not cancelled:
            stats["error"] = result.error.to_json()
        # The engine's final text is the reference (it decodes the whole sequence at once); on an
        # error it has none, so what streamed stays.
        content = result.text or generation.writer.text
        if result.text and generation.writer.text.lstrip().startswith("<think>"):
            content = _with_think_tag(content)  # the same text as streamed, <think> included
        if split_thinking(content)[0] is not None:
            stats["thinking_tokens"] = generation.thinking_tokens
        finished = reason in (FinishReason.STOP, FinishReason.LENGTH)
        generation.writer.finish(finished=finished, stats=stats, content=content)
        info = self.backend.model_info
        if info is not None:
            self.history.set_chat_model(generation.chat_id, info.name)
        self._show_model(info)  # an answer to a parked model loads it back

        message = self.history.get_message(generation.writer.message_id)
        note, kind = message_note(message) if message else (None, NoteKind.INFO)
        if self.current_chat_id == generation.chat_id:
            self.chat_view.end_stream(
                content, note=note, note_kind=kind, thinking_tokens=stats.get("thinking_tokens")
            )
        self._refresh_sidebar()

        if reason == FinishReason.ERROR:
            error = result.error
            self.set_status(f"Generation failed: {error.detail if error else 'unknown error'}", error=True)
        elif cancelled:
            self.set_status("Stopped. The partial answer was kept.")
        else:
            self.set_status("Ready")
        self.perf_panel.end_answer(result.stats)
        self.park_controls.restart_idle_countdown()
        self.refresh_memory()
        if self.slot_dock.isVisible():
            self.slot_panel.refresh()
        # The same source as the answer's footer and the Live speed charts: one figure everywhere.
        speed_text, speed_tip = status_speed(result.stats)
        if speed_text:
            self.speed_label.setText(speed_text)
            self.speed_label.setToolTip(speed_tip)

    def _speculative_for(self, info: ModelInfo | None) -> tuple[str | None, str]:
        """The answer's speculative mode from Settings, and what to say of it. A remote model gets
        none (its server decides); "draft" without a draft model loaded answers with "auto" and says
        so, rather than failing the answer."""
        if info is None or is_remote(info):
            return None, ""
        mode = self.settings.speculative
        if mode == "draft" and not getattr(info, "draft", ""):
            return "auto", " (no draft model is loaded: File > Load draft model…; speculating with auto)"
        return mode, ""

    def _set_busy(self, busy: bool) -> None:
        # Set before the answer's task exists, and cleared while it still runs: `busy` cannot say.
        self._answering = busy
        self.stop_button.setEnabled(busy)
        self.remote.set_busy(busy)
        self._update_send()

    @property
    def can_send(self) -> bool:
        """A model is there to answer, or one is loading (a message sent meanwhile waits for it)."""
        loading = self._loads_running > 0 or self.model_loader.loading
        return self.backend.model_info is not None or loading

    def _update_send(self) -> None:
        """Send only when something can answer; otherwise the window says how to load a model."""
        if self._closed:
            return
        can_send = self.can_send
        self.send_button.setEnabled(can_send and not self._answering)
        self.send_button.setToolTip(SEND_HELP if can_send else NO_MODEL_HELP)
        self.no_model_bar.setVisible(not can_send)
        self.chat_view.setPlaceholderText(EMPTY_CHAT if can_send else NO_MODEL_CHAT)
