"""The conductor service: the public Conductor API on one port, the internal WalkEvents on another.

The public port (clients, the gateway, Envoy) serves ``Conductor``, health and reflection; with
API keys every Conductor call needs ``authorization: Bearer <key>``. The internal port (node
groups only) serves ``WalkEvents`` and health, with mutual TLS when the mesh has certificates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc

from mstar import auth, env, metrics, nvtx, torch_profile, untrusted
from mstar import tls as mtls
from mstar.conductor import act
from mstar.conductor.convert import invalid_argument_status, prompt_from_request
from mstar.conductor.replicas import NoReplica, Replicas, parse_groups
from mstar.conductor.requests import ActiveRequest, RequestTable
from mstar.conductor.run import RequestRun
from mstar.config import Placement, load_config
from mstar.limits import MAX_PUBLIC_MESSAGE_BYTES
from mstar.models.base import InvalidArgument, Prompt, RequestState
from mstar.models.registry import create_model
from mstar.services.grpc_checked import add_checked
from mstar.services.grpc_server import ServerBase, run_service
from mstar.services.transport import PROTOCOL_HELP, TensorReceiver, start_transport
from mstar.services.transport.location import local_location
from mstar.v1 import conductor_pb2 as cpb
from mstar.v1 import conductor_pb2_grpc, node_group_pb2

log = logging.getLogger("mstar.conductor")
PROMPT_WORKERS = 4  # threads reading (decoding) requests of a heavy_prompt model, or large ones, at once
#: a request of more bytes is read on a worker thread whatever the model (tokenising a long text)
INLINE_READ_BYTES = 4096


class ConductorServicer(conductor_pb2_grpc.ConductorServicer):
    def __init__(self, table: RequestTable, max_inflight: int, default_timeout_s: float,
                 api_keys: auth.ApiKeys = auth.NO_KEYS, per_key_max_inflight: int = 0):
        self.table, self.max_inflight, self.default_timeout_s = table, max_inflight, default_timeout_s
        self.model = table.model
        # (API key id, client-visible request_id) -> request: ids are per key, so one key can neither
        # see (ALREADY_EXISTS) nor block nor cancel the ids of another
        self.by_client_id: dict[tuple[str, str], ActiveRequest] = {}
        self.api_keys, self.key_limits = api_keys, auth.KeyLimiter(per_key_max_inflight)
        self.metrics = metrics.RequestMetrics(self.model.name, lambda: len(table.active), max_inflight)
        # where a heavy model's process_prompt runs (video decoding): off the loop that routes every request
        self.prompt_pool = ThreadPoolExecutor(PROMPT_WORKERS, "prompt") if self.model.heavy_prompt else None

    async def _caller(self, context: grpc.aio.ServicerContext) -> str:
        """The calling key's id ("" when the API has no keys); a missing or unknown key aborts
        the call UNAUTHENTICATED."""
        if not self.api_keys.enabled:
            return ""
        token = auth.bearer(next((v for k, v in context.invocation_metadata() or () if k == "authorization"), None))
        kid = self.api_keys.identify(token)
        if kid is None:
            self.metrics.rejected("UNAUTHENTICATED")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or unknown API key: send metadata "
                                "'authorization: Bearer <key>'")
        assert kid is not None  # context.abort raised
        return kid

    async def Generate(self, request: cpb.GenerateRequest, context: grpc.aio.ServicerContext):
        kid = await self._caller(context)
        async for resp in self._run(kid, request.model, partial(prompt_from_request, request), request.request_id,
                                    request.timeout_s, context, size=request.ByteSize()):
            yield resp

    async def Act(self, request: cpb.ActRequest, context: grpc.aio.ServicerContext) -> cpb.ActResponse:
        kid = await self._caller(context)  # before anything about the request is answered
        name = self.model.act_output
        if request.model == self.model.name and name is None:
            self.metrics.rejected("INVALID_ARGUMENT")
            await context.abort_with_status(invalid_argument_status("model", f"model '{self.model.name}' does not "
                                            "serve Act (a policy's call, e.g. pi05's); call Generate"))
        actions, last = None, cpb.GenerateResponse()
        async for resp in self._run(kid, request.model, partial(act.prompt_from_act, request), request.request_id,
                                    request.timeout_s, context, act.act_field, request.ByteSize()):
            actions = next((c.tensor for c in resp.chunks if c.name == name), actions)
            last = resp  # read to the end: the request is released and counted before the reply
        if actions is None or not last.HasField("final"):
            await context.abort(grpc.StatusCode.INTERNAL, f"model '{self.model.name}' finished without its action "
                                                          f"output '{name}'")
        assert actions is not None  # context.abort raised
        return act.act_response(last.request_id, actions, last.final)

    def _read(self, make_prompt: Callable[[], Prompt]) -> tuple[Prompt, RequestState]:
        prompt = make_prompt()
        limit = self.model.max_prompt_chars
        if len(prompt.text) > limit:  # before the model tokenises it
            raise InvalidArgument("text", f"at most {limit} characters (max_seq_len={self.model.max_seq_len} tokens) "
                                          f"for model '{self.model.name}', got {len(prompt.text)}")
        with nvtx.span("conductor: read request"):  # a profiler's range (mstar/torch_profile.py); off: a no-op
            prompt.kwargs = self.model.validate_kwargs(prompt.kwargs)
            return prompt, self.model.process_prompt(prompt)

    def _check_ids(self, client_id: str, timeout_s: float) -> None:
        """The request's own fields the conductor reads before the model does."""
        try:
            untrusted.check_request_id(client_id)
        except untrusted.Untrusted as e:
            raise InvalidArgument("request_id", str(e)) from None
        try:  # the default timeout is also the largest a client may ask for (mstar serve --timeout)
            untrusted.check_timeout(timeout_s, self.default_timeout_s)
        except untrusted.Untrusted as e:
            raise InvalidArgument("timeout_s", str(e)) from None

    def _reading_pool(self, size: int) -> ThreadPoolExecutor | None:
        """Where to read a request of ``size`` bytes: a heavy model's every request and any large one
        go to worker threads, off the loop that routes every request; None: on the loop."""
        if self.prompt_pool is None and size > INLINE_READ_BYTES:
            self.prompt_pool = ThreadPoolExecutor(PROMPT_WORKERS, "prompt")
        return self.prompt_pool if self.model.heavy_prompt or size > INLINE_READ_BYTES else None

    async def _run(self, kid: str, model: str, make_prompt: Callable[[], Prompt], client_id: str, timeout_s: float,
                   context: grpc.aio.ServicerContext, field_name: Callable[[str], str] = str, size: int = 0):
        """One request of the authenticated key ``kid`` from its fields to its last message: the
        model asked for, the request read (``make_prompt``, the model's validate_kwargs and
        process_prompt), admission, its replicas pinned; then its ``RequestRun`` (run.py): the
        walks, timeout, cancellation, metrics, release. Yields GenerateResponse messages; fails by
        aborting ``context``. ``field_name`` renames the field of an INVALID_ARGUMENT into the
        caller's request (Act's names)."""
        t0 = time.perf_counter()
        await self._check_model(model, context)
        prompt, state = await self._read_request(make_prompt, client_id, timeout_s, size, context, field_name)
        rid = client_id or uuid.uuid4().hex
        await self._admit(kid, rid, context)
        process_s = time.perf_counter() - t0
        # the mesh sees a fresh id per request: node groups remember ended ids to drop late
        # frames, so a client may reuse its own id once the earlier request has ended
        ar = ActiveRequest(uuid.uuid4().hex, state, json.dumps(prompt.kwargs), t0)
        await self._pin(kid, ar, context)
        run = RequestRun(self.table, self.metrics, self.by_client_id, self.key_limits, kid, rid, ar,
                         timeout_s or self.default_timeout_s, process_s)
        async for resp in run.responses(context):
            yield resp

    async def _check_model(self, model: str, context: grpc.aio.ServicerContext) -> None:
        if model != self.model.name:
            self.metrics.rejected("NOT_FOUND")
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model: unknown model '{model}'. Served: {self.model.name}")

    async def _read_request(self, make_prompt: Callable[[], Prompt], client_id: str, timeout_s: float, size: int,
                            context: grpc.aio.ServicerContext,
                            field_name: Callable[[str], str]) -> tuple[Prompt, RequestState]:
        """The request's own fields checked, then read by the model (on a worker thread where
        ``_reading_pool`` says); INVALID_ARGUMENT names the field, a bug in the model is INTERNAL."""
        try:
            self._check_ids(client_id, timeout_s)
            pool = self._reading_pool(size)
            if pool is None:
                return self._read(make_prompt)
            return await asyncio.get_running_loop().run_in_executor(pool, self._read, make_prompt)
        except InvalidArgument as e:
            self.metrics.rejected("INVALID_ARGUMENT")
            await context.abort_with_status(invalid_argument_status(field_name(e.field), e.description))
        except Exception as e:  # a bug in the model's validate_kwargs / process_prompt
            log.exception("model '%s' failed reading a request", self.model.name)
            self.metrics.rejected("INTERNAL")
            await context.abort(grpc.StatusCode.INTERNAL, self.table.model_bug(e))
        raise AssertionError("context.abort raised")

    async def _admit(self, kid: str, rid: str, context: grpc.aio.ServicerContext) -> None:
        """Admission: the conductor's in-flight limit, the id free for this key, the key's own limit
        (whose slot is then taken: the request's release gives it back)."""
        if len(self.table.active) >= self.max_inflight:
            self.metrics.rejected("RESOURCE_EXHAUSTED")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"conductor is at its admission limit of {self.max_inflight} in-flight requests; retry later")
        if (kid, rid) in self.by_client_id:
            self.metrics.rejected("ALREADY_EXISTS")
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request_id: '{rid}' is already in flight")
        if kid and not self.key_limits.acquire(kid):
            self.metrics.rejected("RESOURCE_EXHAUSTED")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"API key {kid} is at its limit of "
                                f"{self.key_limits.limit} in-flight requests; retry later")

    async def _pin(self, kid: str, ar: ActiveRequest, context: grpc.aio.ServicerContext) -> None:
        """The request's replica of every node group; UNAVAILABLE (the key's slot given back) where
        a group has none."""
        try:
            self.table.pin(ar)
        except NoReplica as e:
            if kid:
                self.key_limits.release(kid)
            self.metrics.rejected("UNAVAILABLE")
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

    async def Cancel(self, request: cpb.CancelRequest, context):
        kid = await self._caller(context)
        ar = self.by_client_id.get((kid, request.request_id))  # another key's request is not found
        if ar is None or ar.ended:
            return cpb.CancelResponse(cancelled=False)
        self.table.fail(ar, grpc.StatusCode.CANCELLED, f"request '{request.request_id}' was cancelled")
        return cpb.CancelResponse(cancelled=True)

    async def ListModels(self, request, context):
        await self._caller(context)
        m = self.model
        info = cpb.ModelInfo(name=m.name, walks=list(m.walks),
                             outputs=[f"{n}:{mod.name.lower()}" for n, mod in m.outputs.items()],
                             node_groups=self.table.placement.config.group_names, api=_api(m.api()))
        return cpb.ListModelsResponse(models=[info])


class WalkEventsServicer(conductor_pb2_grpc.WalkEventsServicer):
    def __init__(self, table: RequestTable):
        self.table = table
        self.location = local_location("conductor")

    async def Join(self, request: cpb.JoinRequest, context):
        reps = self.table.replicas
        if request.group not in reps.groups:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"group: unknown node group '{request.group}'. "
                                f"Groups: {', '.join(reps.groups)}")
        if ":" not in request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address: expected 'host:port', got '{request.address}'")
        other = next((g for g, known in reps.groups.items() if g != request.group and request.address in known), None)
        if other is not None:  # one address serves one group: a Join cannot relabel another group's replica
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"address: {request.address} is a replica of node "
                                f"group '{other}', not '{request.group}'")
        if request.leave:
            reps.leave(request.group, request.address)
        else:
            reps.join(request.group, request.address)
            self.table.connect(request.group, request.address)
        return cpb.JoinResponse(replicas=reps.serving(request.group))

    async def CheckRoute(self, request: cpb.CheckRouteRequest, context) -> cpb.CheckRouteResponse:
        return cpb.CheckRouteResponse(announced=request.address in self.table.replicas.groups.get(request.group, {}))

    async def Report(self, request_iterator, context):
        receiver = TensorReceiver()
        yield node_group_pb2.Ack(receiver=self.location)
        try:
            async for batch in request_iterator:
                acks: list[int] = []
                decoded = await receiver.decode_batch_async(batch, acks)
                with nvtx.span("conductor: frames in"):
                    self.table.on_batch(batch, decoded)
                if acks:
                    yield node_group_pb2.Ack(released_buffer_ids=acks)
        finally:
            receiver.close()


class ConductorServer(ServerBase):
    """The public server (``Conductor``; ``port``) and the internal one (``WalkEvents``;
    ``internal.port``, mutual TLS with ``tls``) of one conductor. Node groups get the internal
    address; clients, the gateway and Envoy the public one."""

    def __init__(self, address: str, table: RequestTable, max_inflight: int = 256, default_timeout_s: float = 300.0,
                 probe_interval_s: float = 1.0, *, internal_address: str = "127.0.0.1:0",
                 tls: mtls.TLSSettings | None = None, api_keys: auth.ApiKeys = auth.NO_KEYS,
                 per_key_max_inflight: int = 0):
        self.probe_interval_s = probe_interval_s
        self._probe: asyncio.Task | None = None
        self._ready: asyncio.Task | None = None
        super().__init__(address, [cpb.DESCRIPTOR.services_by_name["Conductor"].full_name])
        self.internal = ServerBase(internal_address, [cpb.DESCRIPTOR.services_by_name["WalkEvents"].full_name], tls)
        self.table = table
        self.servicer = ConductorServicer(table, max_inflight, default_timeout_s, api_keys, per_key_max_inflight)
        # requests are untrusted input: unreadable bytes get INVALID_ARGUMENT, the public API reads no
        # message over the clients' limit (services/grpc_checked.py, mstar/limits.py)
        add_checked(conductor_pb2_grpc.add_ConductorServicer_to_server, self.servicer, self.server,
                    MAX_PUBLIC_MESSAGE_BYTES)
        add_checked(conductor_pb2_grpc.add_WalkEventsServicer_to_server, WalkEventsServicer(table), self.internal.server)

    @property
    def internal_port(self) -> int:
        return self.internal.port

    async def start(self) -> None:
        await self.set_serving(False)  # grpc's health servicer starts out SERVING
        await self.internal.server.start()  # node groups join before the public API is ready
        await self.internal.set_serving(True)
        await self.server.start()
        self.table.connect_all()
        loop = asyncio.get_running_loop()
        self._probe = loop.create_task(self.table.replicas.probe_forever(self.probe_interval_s))
        self._ready = loop.create_task(self._serve_when_staffed())

    async def _serve_when_staffed(self) -> None:
        """Ready (health SERVING) once every node group has a replica: those not given at
        start join by themselves."""
        reps = self.table.replicas
        logged = False
        while not all(reps.serving(g) for g in reps.groups):
            if not logged:
                log.info("waiting for a replica of node group(s) %s to join", [g for g in reps.groups if not reps.serving(g)])
                logged = True
            await asyncio.sleep(0.1)
        await self.set_serving(True)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.set_serving(False)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self.table.active and loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self.internal.set_serving(False)
        await self.stop_server(min(1.0, max(0.0, deadline - loop.time())))
        await self.internal.stop_server(min(1.0, max(0.0, deadline - loop.time())))
        for task in (self._probe, self._ready):
            if task is not None:
                task.cancel()
        await self.table.links.close()
        await self.table.replicas.close()
        if self.servicer.prompt_pool is not None:
            self.servicer.prompt_pool.shutdown(wait=False, cancel_futures=True)


def create_server(address: str, table: RequestTable, **kw) -> tuple[ConductorServer, int]:
    server = ConductorServer(address, table, **kw)
    return server, server.port


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mstar-conductor", description="Serve the conductor of a placement config.")
    p.add_argument("--config", required=True)
    p.add_argument("--address", default="127.0.0.1:0", help="host:port of the public API (Conductor; clients, the "
                   "gateway and Envoy)")
    p.add_argument("--internal-address", default="127.0.0.1:0", help="host:port of the internal API (WalkEvents; "
                   "node groups only: give them this as --conductor)")
    mtls.add_args(p)
    p.add_argument("--api-keys-file", default=None, help=auth.API_KEYS_HELP)
    p.add_argument("--per-key-max-inflight", type=int, default=0, help=auth.PER_KEY_HELP)
    p.add_argument("--groups", required=True, help='JSON {"group": "host:port" or ["host:port", ...]}: the replicas of every '
                   "node group known at start (more may Join later)")
    p.add_argument("--probe-interval", type=float, default=1.0, help="seconds between health checks of node-group replicas")
    p.add_argument("--tensor-comm-protocol", default="AUTO", help=PROTOCOL_HELP)
    p.add_argument("--cache-dir", default=None, help="where tokenizers/weights live")
    p.add_argument("--max-inflight", type=int, default=256, help="admission limit (RESOURCE_EXHAUSTED beyond)")
    p.add_argument("--request-timeout", type=float, default=300.0, help="default per-request timeout, seconds")
    p.add_argument("--log-level", default="INFO")
    metrics.add_metrics_arg(p)
    return p.parse_args(argv)


async def serve(args: argparse.Namespace) -> None:
    try:
        tls = mtls.from_args(args, {"--internal-address": args.internal_address}, "conductor")
        api_keys = auth.ApiKeys.load(args.api_keys_file)
    except ValueError as e:
        log.error("%s", e)
        raise SystemExit(2) from None
    if not api_keys.enabled and not mtls.is_loopback(mtls.host_of(args.address)):
        log.warning("conductor: the public API on %s has NO API KEYS: anyone who reaches it may run requests "
                    "(--api-keys-file or MSTAR_API_KEYS)", args.address)
    config = load_config(args.config)
    model = create_model(config.model, config.model_kwargs, args.cache_dir)
    model.prepare_conductor()
    placement = Placement(config, model)
    groups = parse_groups(json.loads(args.groups))
    unknown = set(groups) - set(placement.config.group_names)
    if unknown:
        raise SystemExit(f"--groups names node group(s) {sorted(unknown)} that the config does not have")
    for g in placement.config.group_names:
        if not groups.setdefault(g, []):
            log.warning("node group '%s' has no replica yet: requests fail UNAVAILABLE until one joins", g)
    protocol = start_transport(args.address, args.tensor_comm_protocol, "conductor")
    table = RequestTable(model, placement, Replicas(groups, tls=tls), protocol, tls=tls)
    server, port = create_server(args.address, table, max_inflight=args.max_inflight, default_timeout_s=args.request_timeout,
                                 probe_interval_s=args.probe_interval, internal_address=args.internal_address, tls=tls,
                                 api_keys=api_keys, per_key_max_inflight=args.per_key_max_inflight)
    if args.metrics_port is not None:
        log.info("conductor metrics on port %d", metrics.serve_metrics(args.address, args.metrics_port))
    await server.start()
    log.info("conductor serving model '%s' on port %d (public: Conductor%s), internal port %d (WalkEvents, %s)",
             model.name, port, ", API keys" if api_keys.enabled else ", no API keys", server.internal_port,
             "mutual TLS" if tls else "plaintext")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    profile = torch_profile.arm("conductor", loop)
    await stop.wait()
    await torch_profile.write_pending(profile, loop)
    log.info("conductor draining")
    await server.stop()


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s [conductor] %(name)s: %(message)s")
    env.apply_torch_threads(1)  # its prompt threads' small ops (image decode, features) each on one thread
    run_service(serve(args))


if __name__ == "__main__":
    main()


def _api(a) -> cpb.ModelApi:
    """A model's ``ModelApi`` (models/base.py) on the wire."""
    return cpb.ModelApi(chat_media=list(a.chat_media), chat_kwargs_json=json.dumps(dict(a.chat_kwargs)) if a.chat_kwargs else "",
                        chat_audio_output=a.chat_audio_output, voices=list(a.voices), default_voice=a.default_voice,
                        audio_formats=list(a.audio_formats),
                        edit_kwargs_json="" if a.edit_kwargs is None else json.dumps(dict(a.edit_kwargs)),
                        speech_kwargs_json=json.dumps(dict(a.speech_kwargs)) if a.speech_kwargs else "")
