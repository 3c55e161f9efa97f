"""Sharing this GPU: the stage server a friend's head drives (a plain share, or a join by invite
with its reply code), paused and resumed by the owner's limits (sharing.py) and by sleep.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time

from engine.node.gpu import gpu_summary, own_pids, read_gpus
from engine.node.plain_errors import join_failed, membership_ended
from engine.model.device import release_memory
from engine.node.control_basics import NodeError
from engine.pipeline.stage_server import LEAVE_S

log = logging.getLogger("potluck.node")

# logind lets a sleep inhibitor delay suspend by InhibitDelayMaxSec (5 s by default), and
# Windows gives a power broadcast about 2 s: a stage going to sleep gets this long to be
# let go (its head closes the connection as soon as it starts moving the layers)
SLEEP_LEAVE_S = 3.0


def _not_a_member(account: str) -> bool:
    """A host's refusal of a member's key (engine/wire/invite.py check_member's words)."""
    return "unknown node key" in account or "key was revoked" in account


NOT_KNOWN = ("Your friend's Potluck no longer knows this computer: ask them for a new code, and paste it into "
             "“Join with invite code…”.")
# said after a join that failed, once this computer is back on the share it had left
SHARES_AS_BEFORE = "This computer shares with the friend it shared with before, as it did."


class Sharing:
    """Mixed into control.Node: its __init__ holds the state these methods read and change."""

    async def set_share(self, on: bool):
        kept = self._kept_join() if on and self.invite is None and self._joining is None else None
        if kept is not None:
            # the friend this computer joined last (before Potluck restarted, or before it was
            # switched off): shared with again, as the member the host admitted (its key), with
            # no code to paste again, even once the code has expired
            from engine.wire.invite import InviteError, parse

            try:
                invite = parse(kept["code"])
            except InviteError:
                self._forget_join()
                raise NodeError(NOT_KNOWN) from None
            try:
                await self.join_invite(kept["code"], kept.get("relay", ""), kept=invite)
            except NodeError as exc:
                if not _not_a_member(exc.details or ""):
                    raise           # not reached (asleep, say): the same next time
                self._forget_join()     # the host forgot this computer, or revoked it
                raise NodeError(NOT_KNOWN, exc.status, exc.details) from None
            return
        async with self._lock:
            self.share_wanted = on
            if not on:
                await self._stop_share("sharing switched off by the owner")
                self.paused_reason = None
                return
        await self._apply_policy()

    def check_invite(self, code: str) -> dict:
        """Whose pipeline a code is for, read without joining (the join window asks this
        before it offers to leave the friend shared with now); a code with a typo is said.
        A short code's pipeline only the relay knows, and asking would spend it: None."""
        from engine.boot.join_link import LinkError, is_link, parse_link
        from engine.wire import shortcode
        from engine.wire.invite import InviteError, parse

        try:
            if is_link(code):
                code = parse_link(code).code
            invite = None if shortcode.is_short(code) else parse(code)
        except (InviteError, LinkError) as exc:
            raise NodeError(join_failed(f"that invite code cannot be used: {exc}"), details=str(exc)) from None
        now = (self.invite.pipeline_id if self.invite is not None and (self.stage_server is not None
                                                                       or self._joining is not None) else None)
        return {"pipeline": invite.pipeline_id if invite else None, "shared_with": now}

    async def join_invite(self, code: str, relay: str = "", kept=None) -> dict:
        """Contribute this machine through the host's tunnel (engine/wire/tunnel.py): a stage on
        loopback, reached only through the end-to-end encrypted session the invite opens.
        kept: the kept invite of a host that admitted this computer before (set_share): joined
        as its member, the code read as it is (expired or not)."""
        from engine.node.homes import HomeError, redeem

        try:
            invite = kept or await redeem(code, relay)
        except HomeError as exc:
            raise NodeError(join_failed(str(exc)), details=str(exc)) from None
        gate = getattr(self, "friends_gate", None)
        if gate is not None and invite.pipeline_id == gate.pipeline_id:
            # it would "work": this computer joined to itself, counted as the friend awaited
            raise NodeError("That is this computer's own invite: send it to your friends, who paste it into "
                            "“Join with invite code…” on their computers.")
        async with self._lock:
            # what this computer shared before: it goes back to it if the new join fails (a
            # withdrawn or unreachable invite had left the friend's pipeline for nothing)
            before = (self.invite, self.joiner, self.share_pipeline) if self.share_wanted else None
            await self._stop_share("joining another friend")
            self.invite, self.joiner = invite, None
            self.share_pipeline = invite.pipeline_id
            self.share_wanted = True
            self.error = None
            if not self._decide().paused:
                self._reply_shown = asyncio.Event()
                task = asyncio.ensure_future(self._start_share(reply=True, member=kept is not None))
                shown = asyncio.ensure_future(self._reply_shown.wait())
                await asyncio.wait({task, shown}, return_when=asyncio.FIRST_COMPLETED)
                shown.cancel()
                if task.done():
                    try:
                        task.result()
                        self._keep_join(invite, relay)
                    except NodeError as exc:
                        self.share_wanted, self.invite = False, None
                        if before is not None and await self._share_again(before):
                            raise NodeError(f"{exc.message} {SHARES_AS_BEFORE}", exc.status, exc.details) from None
                        raise
                else:        # waiting for the host to use our reply code
                    self._joining = task
                    task.add_done_callback(lambda t: self._joined_by_reply(t, before))
                    task.add_done_callback(lambda t: t.cancelled() or t.exception() or self._keep_join(invite, relay))
        return await self.status()

    # the friend this computer joined last, kept in its config folder (0600: the code admits
    # whoever holds it while it is fresh): Potluck restarted, or sharing switched back on,
    # joins them again as a member
    def _kept_join_path(self):
        from engine.wire.identity import config_dir

        return config_dir() / "joined.json"

    def _kept_join(self) -> dict | None:
        try:
            kept = json.loads(self._kept_join_path().read_text())
        except (OSError, ValueError):
            return None
        return kept if isinstance(kept, dict) and isinstance(kept.get("code"), str) else None

    def _keep_join(self, invite, relay: str = "") -> None:
        """The invite as a whole code (a short code or a link pasted is spent or longer)."""
        from engine.wire.invite import encode

        code = encode(invite)
        path = self._kept_join_path()
        try:
            tmp = path.with_suffix(".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"code": code, "relay": relay}, f)
            os.replace(tmp, path)
        except OSError as exc:   # a share that works need not be remembered
            log.warning("could not keep the join for the next start: %s", exc)

    def _forget_join(self) -> None:
        try:
            self._kept_join_path().unlink()
        except OSError:
            pass

    async def _share_again(self, before) -> bool:
        """Back to the share `before` a join that failed (a member rejoins as after a pause).
        Whether it is on again (or paused by the owner's limits, to resume by itself)."""
        self.invite, self.joiner, self.share_pipeline = before
        self.share_wanted = True
        if self._decide().paused:
            return True
        try:
            await self._start_share()
            return True
        except NodeError as exc:
            log.warning("could not go back to the share before the join: %s", exc.details or exc.message)
            self.share_wanted, self.invite, self.joiner = False, None, None
            return False

    def _joined_by_reply(self, task: asyncio.Task, before=None):
        if self._joining is task:
            self._joining = None
        self.reply_code = None
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self.error = getattr(exc, "message", None) or str(exc)
            self.share_wanted, self.invite = False, None
            if before is not None:   # as a join that fails at once: back to the share it left
                self._back_task = asyncio.ensure_future(self._back_after_reply(before, self.error))

    async def _back_after_reply(self, before, why: str):
        async with self._lock:
            # the owner did something else meanwhile (shared again, joined another): theirs
            if self.share_wanted or self.invite is not None or self._joining is not None:
                return
            if await self._share_again(before):
                self.error = f"{why} {SHARES_AS_BEFORE}"

    def _on_reply(self, code: str):
        self.reply_code = code
        self._join_event("the host's addresses do not answer from here: send the host your reply code")
        if self._reply_shown is not None:
            self._reply_shown.set()

    async def _start_share(self, reply: bool = False, member: bool = False):
        """reply: a first join, which may offer a reply code (see join_invite); a resume
        after a pause fails instead of waiting on one. member: a join as the host's member."""
        from engine.pipeline.stage_server import StageServer

        if self.stage_server is not None:
            return
        if self.invite is None:
            if self._share_secret is None:
                from engine.wire.identity import share_secret

                self._share_secret = share_secret()
            # whoever connects is someone else's head, even over loopback: it proves the
            # secret and may only ask for models by name (configure_check.remote_model_ok)
            self.stage_server = await StageServer(self.share_host, self.share_port, pipeline=self.share_pipeline,
                                                  secret=self._share_secret, trusted_head=False,
                                                  accept_models=self.accept_models,
                                                  device=self.device, threads=self.threads,
                                                  memory_cap=self._memory_cap()).start()
            log.info("sharing on ws://%s:%d", self.share_host, self.stage_server.port)
            return
        from engine.node.homes import HomeError, join_stage

        try:
            # a resume after a pause rejoins with the same joiner: a member by now
            joined = await join_stage(self.invite, joiner=self.joiner, name=self.join_name,
                                      device=self.device, threads=self.threads,
                                      memory_cap=self._memory_cap(), on_event=self._join_event,
                                      accept_models=self.accept_models,
                                      reply_listen=self.reply_listen if reply and self.reply_listen != "off" else None,
                                      on_reply=self._on_reply, member=member)
        except HomeError as exc:
            raise NodeError(join_failed(str(exc)), 502, details=str(exc)) from None
        self.stage_server, self.joiner = joined.server, joined.joiner
        self.joiner_task = asyncio.ensure_future(self._keep_joined(self.joiner))

    def _memory_cap(self) -> int | None:
        """The owner's VRAM cap in bytes, for a stage started now (None: no cap)."""
        cap = self.policy.limits.vram_cap_mb
        return None if cap is None else int(cap * 2**20)

    def _join_event(self, text: str):
        self.join_events.append(text)
        del self.join_events[:-20]
        log.info("join: %s", text)

    async def _keep_joined(self, joiner):
        try:
            await joiner.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # revoked, or the host refuses us now
            log.warning("membership ended: %s", exc)
            self._forget_join()    # revoked, or refused: not joined again at the next start
            self.error = membership_ended(str(exc))
            self.share_wanted = False
            await self._stop_share("membership ended")

    async def _stop_share(self, why: str, leave_s: float = LEAVE_S):
        joining, self._joining = self._joining, None
        if joining is not None and not joining.done() and joining is not asyncio.current_task():
            joining.cancel()            # its reply listener and stage server close with it
            await asyncio.gather(joining, return_exceptions=True)
        self.reply_code = None
        srv, self.stage_server = self.stage_server, None
        if srv is None:
            return
        if srv.stage is not None:
            # tell the head first: it moves this stage's layers to the others and replays
            # the conversations there, then lets go (or we go anyway after leave_s)
            await srv.leave(why, leave_s)
        if srv.connected:   # the head hears why before the server goes
            await srv.close(why)
        task, self.joiner_task = self.joiner_task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if self.joiner is not None and self.joiner.session is not None:
            try:
                await self.joiner.session.close(why[:120])
            except Exception:
                pass
        await srv.close(wait_s=10)  # until the port is free: sharing may start again on it
        srv.stage = None
        release_memory(self.device)  # the owner gets the slice's memory back, not only the GPU

    def _decide(self, reading=None):
        return self.policy.evaluate(reading, own_pids(), self.idle_seconds, time.monotonic())

    async def _apply_policy(self):
        gpus, _why = await asyncio.get_running_loop().run_in_executor(None, read_gpus)
        decision = self._decide(gpus[0] if gpus else None)
        async with self._lock:
            if self.asleep:
                self.paused_reason = "this computer is asleep"
                return
            self.paused_reason = decision.reason if decision.paused else None
            if not self.share_wanted:
                return
            srv = self.stage_server
            if srv is not None and srv.closed and self.invite is None:
                # it stopped by itself (a head told it to shut down, it crashed): the toggle
                # still says "sharing", so share again rather than report a port nobody serves
                self.share_restarts += 1
                self.share_stopped = "its part of your friend's model stopped by itself; started again"
                log.warning("%s (%d so far)", self.share_stopped, self.share_restarts)
                self.stage_server = None
                await srv.close(wait_s=10)  # until the port is free
            if decision.paused and self.stage_server is not None:
                # the friends hear that it paused, not why: the reasons are the owner's, in words
                # for them ("while you are away", what else runs on their GPU)
                await self._stop_share("its owner's computer paused sharing")
            elif not decision.paused and self.stage_server is None and (self._joining is None or self._joining.done()):
                try:
                    await self._start_share()
                except (OSError, NodeError) as exc:
                    self.error = f"Could not share this GPU: {getattr(exc, 'message', exc)}"
                    self.share_wanted = False
                    if _not_a_member(getattr(exc, "details", None) or ""):
                        self._forget_join()     # revoked: not joined again at the next start

    async def _policy_loop(self):
        while True:
            try:
                self.gpu = await asyncio.get_running_loop().run_in_executor(None, gpu_summary)
                await self._apply_policy()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("policy check failed")
            await asyncio.sleep(self.poll_seconds)
