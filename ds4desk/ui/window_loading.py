"""The window's model loading: start a load, fall back from a failed GPU, the device check, Settings,
and the model picker. MainWindow inherits it."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path

import shiboken6

from ds4desk.engine.api import (
    DeviceChoice,
    EngineError,
    ErrorCode,
    LoadRequest,
    LoadResult,
)
from ds4desk.remote import is_remote
from ds4desk.settings import BUILT_IN_MODEL
from ds4desk.ui.banners import (
    DEVICE_FALLBACK,
    LOAD_FAILED,
)
from ds4desk.ui.device_choice import canonical, fallback_for
from ds4desk.ui.model_picker import ModelPicker, PickerHooks
from ds4desk.ui.settings_dialog import SettingsDialog

log = logging.getLogger(__name__)

BUILT_IN_LOADING = "Loading the built-in model (SmolLM2)…"
FIRST_START_NOTE = " The first load also starts the engine, which takes a few seconds."


class ModelLoading:
    """MainWindow's loading and settings; the widgets and state it reads are MainWindow's."""

    # ---- model loading --------------------------------------------------------------------

    def start_load(
        self, path: str | None = None, *, remember: bool = False, recent: bool = False
    ) -> asyncio.Task[LoadResult]:
        """Load in the background; a message sent meanwhile waits for it."""
        load = self.load_model(path, remember=remember, recent=recent)
        return self.model_loader.track(asyncio.ensure_future(load))

    async def load_model(
        self,
        path: str | None = None,
        *,
        remember: bool = False,
        recent: bool = False,
        draft: str | None = None,
    ) -> LoadResult:
        """`remember`: a successful load becomes the model to load next time (and first in File >
        Open recent); `recent`: only first in Open recent (a model given on the command line).
        `draft`: a draft model loaded beside it, for speculative decoding (File > Load draft model…)."""
        wanted = self.settings.load_request(path)
        label = Path(wanted.path).name if wanted.path else "the built-in model (SmolLM2)"
        status = f"Loading {label}…" if wanted.path else BUILT_IN_LOADING
        if draft is not None:
            status = f"Loading {label} with the draft model {Path(draft).name or draft}…"
        self.set_status(status + (FIRST_START_NOTE if self._loads_done == 0 else ""))
        self.model_label.setText("Loading…")
        self.open_model_action.setEnabled(False)
        self._loads_running += 1
        self._update_send()  # a message may be typed and sent now: it waits for the load
        try:
            return await self._load_model(path, label, remember=remember, recent=recent, draft=draft)
        finally:
            self._loads_running -= 1
            self._update_send()

    async def _load_model(
        self, path: str | None, label: str, *, remember: bool, recent: bool, draft: str | None = None
    ) -> LoadResult:
        await self._check_device()  # the first time, the engine side is asked which devices exist
        if self._closed:
            return LoadResult(error=EngineError(ErrorCode.CANCELLED, "the window closed"))
        request = self.settings.load_request(path, self.model_loader.device_override, draft)
        started = time.monotonic()
        result = await self._backend_load(request)
        if self._gpu_failed(request, result) and not self._closed:
            result = await self._load_on_cpu_instead(request, result)
        self._loads_done += 1
        if self._closed:
            return result
        self.open_model_action.setEnabled(True)
        self._show_model(self.backend.model_info)  # a failed load may have kept the previous model
        if result.ok and result.info is not None:
            self.park_controls.restart_idle_countdown()
            self.refresh_memory()
            if self.slot_dock.isVisible():
                self.slot_panel.refresh()
            seconds = result.seconds or time.monotonic() - started
            unloaded = " (the previous model was unloaded first: memory holds one)" * result.dropped_previous
            if draft is not None:
                name = Path(draft).name or draft
                self.set_status(f"Draft model {name} loaded beside {result.info.name} in {seconds:.1f} s")
            else:
                self.set_status(f"Model {result.info.name} loaded in {seconds:.1f} s{unloaded}")
            self.notice_bar.remove(LOAD_FAILED)  # an earlier failure is over
            chosen = path if path is not None else request.path
            self.current_model_path = chosen or BUILT_IN_MODEL
            if remember and chosen:
                self.model_loader.remember(chosen)
                self._save_settings()
            elif recent and chosen:
                self.model_loader.add_recent(chosen)
                self._save_settings()
        elif result.error is not None and result.error.code == ErrorCode.CANCELLED:
            kept = self.backend.model_info
            self.set_status(f"Loading {label} cancelled" + (f"; {kept.name} is still loaded" if kept else ""))
        else:
            detail = result.error.detail if result.error else "the engine gave no reason"
            kept = self.backend.model_info
            still = f" {kept.name} is still loaded." if kept else ""
            if draft is not None:
                label = f"the draft model {Path(draft).name or draft} beside {label}"
            # A notice above the chat, not a line in it: a failed load belongs to no conversation.
            self.show_notice(f"Could not load {label}: {detail.rstrip('.')}.{still}", key=LOAD_FAILED)
            self.set_status(f"Could not load the model: {detail}", error=True)
        return result

    async def _backend_load(self, request: LoadRequest) -> LoadResult:
        try:
            return await self.model_loader.load(request)
        except Exception as exc:  # the backend promises not to raise; a bug must not kill the window
            log.exception("load raised")
            return LoadResult(error=EngineError(ErrorCode.LOAD_FAILED, f"{type(exc).__name__}: {exc}"))

    def _gpu_failed(self, request: LoadRequest, result: LoadResult) -> bool:
        """The load failed on a device that may be a GPU: worth one more try on the CPU. A file
        that is no model fails the same everywhere, but the engine cannot tell us which part failed,
        and a second failure costs a header read. A model too big for the GPU is not moved to the
        CPU behind the user's back: it would be slow, and may not fit there either."""
        if result.ok or result.error is None:
            return False
        if result.error.code in (ErrorCode.CANCELLED, ErrorCode.OUT_OF_MEMORY):
            return False
        devices = request.devices or (request.device,)
        if all(canonical(d) == "cpu" for d in devices):
            return False
        choices = self.device_choices
        # auto is the CPU on a machine without a GPU: it already failed there.
        cpu_only = choices is not None and not any(c.name.startswith("cuda") for c in choices)
        return not (devices == ("auto",) and cpu_only)

    async def _load_on_cpu_instead(self, request: LoadRequest, failed: LoadResult) -> LoadResult:
        """GPU -> CPU: the saved device failed, so this load runs on the CPU and the window says why.
        The setting is left alone (the GPU may work next time); the notice says where to change it."""
        where = ", ".join(request.devices) if request.devices else request.device
        detail = failed.error.detail if failed.error else "no reason given"
        self.set_status(f"Loading on {where} failed; trying the CPU…", error=True)
        result = await self._backend_load(replace(request, device="cpu", devices=None, layer_split=None))
        if result.ok:
            self.show_notice(
                f"The model could not be loaded on {where} ({detail}), so it was loaded on the CPU "
                "instead. Choose another device in Settings > Device.",
                key=DEVICE_FALLBACK,
            )
            return result
        return failed  # the CPU failed too: the first reason is the one to show

    async def known_devices(self) -> list[DeviceChoice] | None:
        """The devices this torch sees, asked of the engine side once; None when it cannot say."""
        if self.device_choices is None and self._list_devices is not None:
            try:
                self.device_choices = list(await self._list_devices())
            except Exception as exc:  # the list is a check, never a reason not to load
                log.warning("listing the devices failed: %s", exc)
        return self.device_choices

    async def _check_device(self) -> None:
        """A device this machine does not have (saved, or given with --device) is replaced by the
        first GPU, else the CPU, for this session; the notice says why and stays until dismissed.
        The saved setting is left alone: the GPU may be back next time."""
        await self.known_devices()
        if not self._closed:
            self._apply_device_check()

    def _apply_device_check(self) -> None:
        wanted = self._device_override or self.settings.device
        choices = self.device_choices
        fallback = fallback_for(wanted, choices) if choices is not None else None
        self.model_loader.device_override = fallback.instead if fallback else self._device_override
        if fallback is not None and fallback != self.device_fallback:
            self.show_notice(fallback.why, key=DEVICE_FALLBACK)
        self.device_fallback = fallback

    # ---- the draft model ----------------------------------------------------------------------

    def choose_draft_model(self) -> asyncio.Task[LoadResult] | None:
        """File > Load draft model…: a file dialog like File > Open, then load_draft."""
        path = self.model_loader.choose_path("Load draft model")
        return self.load_draft(path) if path else None

    def load_draft(self, path: str) -> asyncio.Task[LoadResult] | None:
        """Load `path` as the draft model beside the loaded one: a load of the same model with this
        draft, which the engine answers by loading the draft alone (the model, its graphs and its
        snapshots stay); a draft that cannot draft for it (another vocabulary) is refused and the
        model stays as it was."""
        info = self.backend.model_info
        if info is None or is_remote(info) or self.current_model_path is None:
            self.set_status("Load a local model first: a draft model drafts for it.", error=True)
            return None
        if self.model_loader.loading:
            self.set_status("A model is still loading: wait for it (or cancel it) first.", error=True)
            return None
        load = self.load_model(self.current_model_path, draft=path)
        return self.model_loader.track(asyncio.ensure_future(load))

    def _update_draft_action(self) -> None:
        """A draft needs a local model loaded, and no load running."""
        if self._closed or not hasattr(self, "load_draft_action"):
            return
        info = self.backend.model_info
        self.load_draft_action.setEnabled(
            info is not None and not is_remote(info) and not self.model_loader.loading
        )

    def open_settings(self) -> SettingsDialog:
        """Settings (Ctrl+,): window-modal, not blocking; OK saves them."""
        info = self.backend.model_info
        dialog = SettingsDialog(
            self.settings,
            self,
            devices=self.device_choices,
            can_serve=self.serve_control.available,
            can_speculate=not is_remote(info),
            serving_url=self.serve_control.url,
        )
        if self.device_choices is None and self._list_devices is not None:
            self._device_task = asyncio.ensure_future(self._list_devices_into(dialog))
        dialog.accepted.connect(self._on_settings_accepted)
        dialog.finished.connect(dialog.deleteLater)
        self.settings_dialog = dialog
        dialog.open()
        return dialog

    async def _list_devices_into(self, dialog: SettingsDialog) -> None:
        choices = await self.known_devices()
        if choices is not None and not self._closed and shiboken6.isValid(dialog) and dialog.isVisible():
            dialog.set_devices(choices)

    def _on_settings_accepted(self) -> None:
        self._apply_device_check()  # a new device holds for the next load, a drop's check included
        self._save_settings()
        self.chat_options.sync()
        self.set_status("Settings saved. Model options apply at the next model load.")
        self.serve_control.apply()  # serving starts, stops or moves now; it says so when it does

    def _save_settings(self) -> None:
        if self._settings_path is None:
            return
        try:
            self.settings.save(self._settings_path)
        except OSError as exc:
            self.set_status(f"Could not save settings: {exc}", error=True)

    # ---- the model picker ---------------------------------------------------------------------

    def open_model_picker(self) -> ModelPicker:
        """File > Choose model… (Ctrl+L): window-modal, not blocking; a row loads like File > Open."""
        picker = self.model_picker
        if picker is not None and shiboken6.isValid(picker) and picker.isVisible():
            picker.raise_()
            return picker
        hooks = PickerHooks(
            open_model=self.model_loader.open_path,
            load_request=lambda path: self.settings.load_request(path, self.model_loader.device_override),
            current_path=lambda: self.current_model_path if self.backend.model_info is not None else None,
            save_settings=self._save_settings,
        )
        picker = ModelPicker(self.settings, self.backend, hooks, self)
        picker.finished.connect(picker.deleteLater)
        self.model_picker = picker
        picker.open()
        return picker
