"""An HTTP JSON API over one resident :class:`QueryEngine` (model, indices and preconditioners loaded
once), with a small web page to type a query and see the top training examples as token heatmaps.

Endpoints: ``POST /query``, ``GET /exact/{id}``, ``GET /example/{id}``, ``GET /health``, ``GET /`` (the page).
A query asking for the exact stage (``rerank_full``) is answered by the first stage at once, with the id
of its exact stage, which the worker runs a forward + backward at a time while no other request waits
(``GET /exact/{id}``: its progress, then its answer).
With a token, ``/query``, ``/exact`` and ``/example`` need ``Authorization: Bearer <token>`` (401, checked before any
of the body is read); the page and ``/health`` hold no data and stay open. A request body over
:data:`MAX_BODY` bytes is answered 413 without being read further. The engine is not thread-safe:
one worker thread owns it (:mod:`gradindex.apps.batching`) and answers the queries waiting
together in one gradient pass; a full queue answers 503 (``Retry-After``), a request past
``request_timeout`` 504. ``/health`` and the page offer exactly the methods the index answers
(:func:`gradindex.methods.methods_of`), the index's default first and preselected, and ``/health``
reports each stage's seconds over the last queries (:mod:`gradindex.apps.timings`). No endpoint
reads or writes a file the client names.
"""

from __future__ import annotations

import asyncio
import copy
import hmac
import json
import logging
import time

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gradindex import distributed
from gradindex.apps.batching import Background, Batcher, Expired, Job, QueryJob, Stopped
from gradindex.apps.explain import Explainer
from gradindex.apps.html import LEGEND, page
from gradindex.apps.state import IndexState
from gradindex.apps.texts import capped_result
from gradindex.apps.timings import StageTimes
from gradindex.methods import DEFAULT_DAMPING, all_methods, methods_of
from gradindex.query import QueryEngine, QueryResult

log = logging.getLogger("gradindex")

MAX_TEXT = 20_000
"""Characters of a query text (or prompt + completion); longer is refused (the index truncates tokens)."""
MAX_K = 1000
MAX_EXPLAIN = 50
"""Results explained token by token in one request; also the most results the page asks for (it explains
all it shows)."""
MAX_BODY = 1 << 20
"""Bytes of a request body: room for the longest valid query (``MAX_TEXT`` characters of prompt and of
completion as ``\\uXXXX`` escapes, or ``MAX_TEXT`` token ids and labels), not for a flood."""
GUARDED = ("/query", "/exact/", "/example/")
"""Paths that hold data: the bearer token (when set) is checked there before the body is read."""


class QueryRequest(BaseModel):
    """One query in one of the forms of ``gradindex query``, and how to answer it."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = Field(None, min_length=1, max_length=MAX_TEXT, description="Loss on every next token.")
    prompt: str | None = Field(None, max_length=MAX_TEXT, description="No loss; with completion.")
    completion: str | None = Field(None, min_length=1, max_length=MAX_TEXT, description="Loss on it.")
    input_ids: list[int] | None = Field(None, min_length=2, max_length=MAX_TEXT)
    labels: list[int] | None = Field(None, description="With input_ids: -100 where no loss is taken.")
    messages: list[dict[str, str]] | None = Field(None, min_length=1, max_length=1000,
                                                  description="A chat: [{role, content}, ...]; loss on its replies.")
    target: str | None = Field(None, min_length=1, max_length=MAX_TEXT,
                               description="Measure only this piece of the answer (the completion, reply or text).")
    k: int = Field(10, ge=1, le=MAX_K)
    method: str | None = Field(None, description="Default: ekfac-selfnorm where the index answers ekfac (ekfac with "
                                                "explain), else graddot.")
    damping: float = Field(DEFAULT_DAMPING, gt=0, le=1e6)
    layers: list[str] | None = Field(None, max_length=1000)
    lowest: int = Field(0, ge=0, le=MAX_K)
    explain: int = Field(0, ge=0, le=MAX_EXPLAIN,
                         description="Explain the top N results token by token (graddot, kfac, ekfac).")
    rerank_full: int | None = Field(None, ge=0, le=1000,
                                    description="The exact stage: candidates re-ranked in full space (a forward + "
                                                "backward each; kfac/ekfac need the full-space fit), answered "
                                                "later at GET /exact/{id}; default and 0: none.")

    @model_validator(mode="after")
    def _one_form(self) -> QueryRequest:
        forms = [self.text is not None, self.prompt is not None or self.completion is not None,
                 self.input_ids is not None, self.messages is not None]
        if sum(forms) != 1:
            raise ValueError("give exactly one query: text, prompt + completion, input_ids, or messages")
        if (self.prompt is None) != (self.completion is None):
            raise ValueError("prompt and completion go together (the loss is taken on the completion)")
        if self.labels is not None and (self.input_ids is None or len(self.labels) != len(self.input_ids)):
            raise ValueError("labels go with input_ids, one per token")
        if self.method is not None and self.method not in all_methods("serve"):
            raise ValueError(f"method {self.method!r} is not one of {', '.join(all_methods('serve'))}")
        if self.explain and self.method is not None and self.method not in all_methods("explain", selfnorm=False):
            raise ValueError(f"explain works for {', '.join(all_methods('explain', selfnorm=False))}, "
                             f"not {self.method!r}")
        return self

    def record(self) -> dict:
        rec: dict = {} if self.target is None else {"target": self.target}
        if self.text is not None:
            return rec | {"text": self.text}
        if self.prompt is not None:
            return rec | {"prompt": self.prompt, "completion": self.completion}
        if self.messages is not None:
            return rec | {"messages": self.messages}
        rec["input_ids"] = self.input_ids
        if self.labels is not None:
            rec["labels"] = self.labels
        return rec


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors():
        loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body",))
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts) or "invalid request"


def _answerer(batcher: Batcher, request_timeout: float, state: IndexState):
    """The coroutine that queues a job on ``batcher`` and waits for its answer, errors as HTTP statuses
    (:meth:`IndexState.http_error`)."""

    async def answer(job: Job):
        """Queue ``job`` and wait for the worker's answer, within the request's time limit; a damaged index, or
        one a build replaced, is refused (503) before it is queued."""
        state.refuse()
        if not batcher.submit(job):
            raise HTTPException(503, f"busy: {batcher.queue_size} requests are already waiting (the queue is "
                                     "full); retry in a second", headers={"Retry-After": "1"})
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job.future), max(0.0, job.deadline - time.monotonic()))
        except (asyncio.TimeoutError, Expired):
            job.future.cancel()  # the worker skips it if it has not started it
            batcher.note_timeout()
            raise HTTPException(504, f"no answer within the request time limit ({request_timeout:g} s): the "
                                     "server is busy or the query is slow; retry later") from None
        except Stopped as e:
            raise HTTPException(503, str(e), headers={"Retry-After": "5"}) from None
        except Exception as e:  # the worker goes on; this request failed inside the engine
            raise state.http_error(e) from e

    return answer


def _add_query(app: FastAPI, engine: QueryEngine, answer, answers: list[str], default: str,
               request_timeout: float) -> None:
    """``POST /query``: check the request, queue it, add the explanations asked for and the stage timings; texts
    capped (:func:`~gradindex.apps.texts.capped`), notes without server paths. With ``rerank_full`` the first
    stage answers (with ``k >= rerank_full`` candidates kept for the exact stage) and the exact stage is queued
    as background work (:func:`_exact_work`)."""
    explainer = Explainer(engine)
    vocab = engine.model.get_input_embeddings().num_embeddings
    stages = app.state.stages

    @app.post("/query")
    async def query(req: QueryRequest) -> dict:
        t0 = time.monotonic()
        method = _checked_method(req, engine, vocab, answers, default)
        rec = req.record()
        finish = _finisher(app, engine, explainer, req, rec, method)
        settings = {"method": req.method or (method if req.explain else None), "damping": req.damping,
                    "layers": req.layers, "lowest": req.lowest,
                    "rerank_full": 0 if req.rerank_full else None}  # (the exact stage runs later)
        k = max(req.k, req.rerank_full or 0)
        job = Job(QueryJob(rec, k, settings, finish), deadline=t0 + request_timeout)
        out = capped_result(await answer(job))
        out["notes"] = [app.state.index.public(n) for n in out.get("notes", [])]
        out["batch"] = job.batch
        out["seconds"]["queue"] = job.started - job.queued
        out["seconds"]["total"] = time.monotonic() - t0
        stages.add(out["seconds"])
        return out


def _checked_method(req: QueryRequest, engine: QueryEngine, vocab: int, answers: list[str], default: str) -> str:
    """The method ``req`` is answered with, once its token ids and method are checked (422 otherwise)."""
    bad = [i for i in (req.input_ids or []) if not 0 <= i < vocab]
    bad += [i for i in (req.labels or []) if i != -100 and not 0 <= i < vocab]
    if bad:
        raise HTTPException(422, f"token ids {bad[:3]} are outside the model's vocabulary (0..{vocab - 1}; "
                                 "labels may also be -100)")
    # no method: the query default (the engine's, which answers plain ekfac with a note where the self-influence
    # cannot be had); with explain, the base method, whose scores explanations split (ekfac, not -selfnorm)
    method = req.method or (engine.base_method() if req.explain else default)
    if method not in answers:
        raise HTTPException(422, f"method {method!r} is not one this index answers: it answers "
                                 f"{', '.join(answers)} (default {default})")
    if req.explain and method not in all_methods("explain", selfnorm=False):
        raise HTTPException(422, f"explain works for {', '.join(all_methods('explain', selfnorm=False))}, "
                                 f"not {method!r}")
    return method


def _finisher(app: FastAPI, engine: QueryEngine, explainer: Explainer, req: QueryRequest, rec: dict, method: str):
    """What the worker does with the first stage's answer of ``req`` (``None``: nothing more): its explanations,
    and its exact stage queued (refused there if impossible: no full-space fit, no training data)."""
    if not (req.explain or req.rerank_full):
        return None

    def finish(r: QueryResult) -> dict:
        exact = None
        if req.rerank_full:
            exact = _exact_work(app, engine, rec, r, req.rerank_full, req.k, req.damping)
            r.hits = r.hits[:req.k]
        out = explained(r) if req.explain else r.to_dict()
        if exact is not None:
            out["exact"] = exact
        return out

    def explained(r: QueryResult) -> dict:
        out = r.to_dict()
        if r.hits:
            t1 = time.perf_counter()
            exps = explainer.explain(rec, [h.id for h in r.hits[:req.explain]], method, req.damping, r.layers)
            for h, e in zip(out["hits"], exps, strict=False):
                h["explanation"] = {"tokens": e.train.tokens, "scores": e.train.scores,
                                    "query_tokens": e.query.tokens, "query_scores": e.query.scores}
            out["seconds"]["explain"] = time.perf_counter() - t1
        return out

    return finish


def _exact_work(app: FastAPI, engine: QueryEngine, rec: dict, first: QueryResult, top: int, k: int,
                damping: float) -> dict:
    """Queue the exact stage of ``first`` (its top ``top``) as background work; what ``POST /query`` says of it."""
    steps = engine.exact_steps([copy.deepcopy(first)], [rec], top, damping)

    def done(results: list[QueryResult]) -> dict:
        r = results[0]
        r.hits = r.hits[:k]
        out = capped_result(r.to_dict())
        out["notes"] = [app.state.index.public(n) for n in out.get("notes", [])]
        return out

    work = Background(steps, done)
    if not app.state.batcher.start_background(work):
        return {"status": "refused", "detail": f"{app.state.batcher.queue_size} exact stages are already waiting; "
                                               "retry later"}
    return {**work.to_dict(), "url": f"/exact/{work.id}"}


def _add_exact(app: FastAPI, batcher: Batcher, state: IndexState) -> None:
    """``GET /exact/{id}``: a query's exact stage, its progress, and its answer once done (as ``POST /query``'s)."""

    @app.get("/exact/{work_id}")
    async def exact(work_id: str) -> dict:
        work = batcher.background(work_id)
        if work is None:
            raise HTTPException(404, f"no exact stage {work_id!r}: the last {batcher.KEPT} are kept")
        out = work.to_dict()
        if work.status == "done":
            out["result"] = work.answer
        elif work.status == "failed":
            err = state.http_error(work.error)  # (the status a request failing so would get, and its reason)
            out["detail"], out["code"] = err.detail, err.status_code
        return out


def create_app(engine: QueryEngine, token: str | None = None, request_timeout: float = 30.0, queue_size: int = 64,
               max_batch: int = 16, batch_window: float = 0.002) -> FastAPI:
    """The FastAPI app over ``engine`` (which it does not close); ``app.state.batcher`` owns the engine."""
    if not request_timeout > 0:
        raise ValueError(f"request_timeout must be > 0 seconds, got {request_timeout}")
    app = FastAPI(title="gradindex", description="Which training examples made the model say this?",
                  docs_url=None, redoc_url=None, openapi_url=None)
    batcher = Batcher(engine, max_batch=max_batch, queue_size=queue_size, window=batch_window)
    app.state.batcher = batcher
    default = engine.resolve_method()  # the query default: ekfac-selfnorm where the index answers ekfac
    answers = methods_of(engine.manifest, engine.dir, selfnorm=True)
    answers = [default] + [m for m in answers if m != default]
    app.state.stages = StageTimes()
    state = IndexState(engine.dir, engine.check_current, getattr(engine, "lost", None))
    app.state.index = state
    app.add_middleware(Guard, token=token, max_body=MAX_BODY)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return JSONResponse({"detail": _validation_message(exc)}, status_code=422)

    answer = _answerer(batcher, request_timeout, state)
    _add_health(app, engine, answers, default, request_timeout)
    _add_query(app, engine, answer, answers, default, request_timeout)
    _add_exact(app, batcher, state)
    _add_example(app, engine, answer, request_timeout)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> str:
        return _page(answers, default, token is not None, engine.n)

    return app


def _add_health(app: FastAPI, engine: QueryEngine, answers: list[str], default: str, request_timeout: float) -> None:
    """``GET /health``: the index's state (503 unless ``ok``), the methods offered, the queue, the stage timings."""
    batcher, state, stages = app.state.batcher, app.state.index, app.state.stages
    probe = getattr(engine, "probe_ranks", None) if distributed.active() else None  # (a sharded index's ranks)
    probing: dict = {"at": time.monotonic(), "job": None}

    @app.get("/health")
    async def health() -> JSONResponse:
        if probe is not None and state.status() == "ok":
            await _probe()
        status = state.status()  # 503 unless "ok": a monitor sees a damaged or replaced index by the code alone
        return JSONResponse(_health(status), status_code=200 if status == "ok" else 503)

    async def _probe() -> None:
        """Ask every rank to answer (at most every :data:`PROBE_EVERY` s, through the worker, as searches are): a
        rank that died while the server was idle is found lost, and this or the next /health says so."""
        job = probing["job"]
        if (job is not None and not job.future.done()) or time.monotonic() - probing["at"] < PROBE_EVERY:
            return
        probing["at"], probing["job"] = time.monotonic(), Job(probe, deadline=time.monotonic() + request_timeout)
        if batcher.submit(probing["job"]):
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(probing["job"].future)), PROBE_WAIT)
            except Exception:  # noqa: BLE001 -- a lost rank is recorded by the probe itself (state.status)
                pass

    def _health(status: str) -> dict:
        return {"status": status, "examples": engine.n, "layers": len(engine.select_layers(None)),
                "methods": answers, "default_method": default,
                "queue": {"depth": batcher.depth(), "answering": batcher.answering, "size": batcher.queue_size,
                          "exact_waiting": batcher.background_depth(),
                          "max_batch": batcher.max_batch, "window_s": batcher.window,
                          "request_timeout_s": request_timeout},
                "served": batcher.stats.to_dict(), "stages": stages.to_dict()}


PROBE_EVERY = 5.0
"""Seconds between two probes of a sharded index's ranks by ``/health``."""
PROBE_WAIT = 2.0
"""Seconds a ``/health`` waits for its probe's answer before it answers with the state as it is."""


def _add_example(app: FastAPI, engine: QueryEngine, answer, request_timeout: float) -> None:
    """``GET /example/{id}``: the whole text of one training example, read by the worker."""
    state = app.state.index

    @app.get("/example/{example_id}")
    async def example(example_id: int) -> dict:
        """The whole text of one training example (results carry at most ``RESULT_TEXT_CHARS`` of it)."""
        if not 0 <= example_id < engine.n:
            raise HTTPException(404, f"no training example {example_id}: ids are 0..{engine.n - 1}")

        def read() -> dict:
            cols = engine.example_columns(("num_tokens", "loss"), [example_id])  # (first: a sharded index's other
            text = engine.texts.texts(np.array([example_id], dtype=np.int64))[0]  # rank sends the text's hash too)
            note = engine.texts.problem
            return {"id": example_id, "text": text, "text_chars": None if text is None else len(text),
                    "num_tokens": int(cols["num_tokens"][0]), "loss": float(cols["loss"][0]),
                    "note": note and state.public(note)}

        return await answer(Job(read, deadline=time.monotonic() + request_timeout))


def _page(answers: list[str], default: str, auth: bool, n: int) -> str:
    """The page: the methods offered (the default selected), which of them draw heatmaps, the k field's limit."""
    options = "".join(f"<option{' selected' if m == default else ''}>{m}</option>" for m in answers)
    explainable = json.dumps([m for m in answers if m in all_methods("explain", selfnorm=False)])
    return (_PAGE.replace("__METHODS__", options).replace("__EXPLAIN__", explainable).replace("__N__", str(n))
            .replace("__AUTH__", "block" if auth else "none").replace("__MAXK__", str(MAX_EXPLAIN)))


class Guard:
    """ASGI middleware before the routes of :data:`GUARDED`: the bearer token from the headers alone
    (401 before any body is read), then the body read up to ``max_body`` bytes (413 past it: from
    ``Content-Length`` unread, else as soon as the chunks pass it) and handed on from memory."""

    def __init__(self, app, token: str | None, max_body: int):
        self.app, self.token, self.max_body = app, token, max_body

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GUARDED):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.token is not None and not _bearer_ok(headers.get(b"authorization", b""), self.token):
            return await _reply(send, 401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                                [(b"www-authenticate", b"Bearer")])
        length = headers.get(b"content-length", b"0")
        too_big = f"request body over {self.max_body} bytes; a query needs far less"
        if not length.isdigit() or int(length) > self.max_body:
            return await _reply(send, 413, too_big)
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # the client went away
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            if size > self.max_body:
                return await _reply(send, 413, too_big)
        body, sent = b"".join(chunks), False

        async def replay():
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def _bearer_ok(got: bytes, token: str) -> bool:
    return got.startswith(b"Bearer ") and hmac.compare_digest(got[7:], token.encode())


async def _reply(send, status: int, detail: str, headers: list | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


_BODY = """
<h1>gradindex</h1><p class="muted">Which of the __N__ training examples made the model say this?</p>
<form id="f"><p><label>Query text<br><textarea id="text" rows="3" style="width:100%"></textarea></label></p>
<p><label>or prompt <input id="prompt" size="40"></label> <label>completion <input id="completion" size="40">
</label></p><p><label>k <input id="k" type="number" value="5" min="1" max="__MAXK__" style="width:4em"></label>
<label>method <select id="method">__METHODS__</select></label>
<span style="display:__AUTH__"><label>token
<input id="token" type="text" autocomplete="off" spellcheck="false" size="16"></label></span>
<button type="submit">Find</button></p></form>
<div id="legend" style="display:none">""" + LEGEND + """</div><div id="status" class="muted"></div><div id="out"></div>
"""

_SCRIPT = """
function gxRun(){var st=document.getElementById('status'),out=document.getElementById('out');
var body={k:parseInt(document.getElementById('k').value||'5'),method:document.getElementById('method').value};
var t=document.getElementById('text').value,p=document.getElementById('prompt').value,
c=document.getElementById('completion').value;if(t){body.text=t;}else{body.prompt=p;body.completion=c;}
if(__EXPLAIN__.indexOf(body.method)>=0){body.explain=Math.min(body.k,__MAXK__);}
var h={'Content-Type':'application/json'},tok=document.getElementById('token').value;
if(tok){h.Authorization='Bearer '+tok;}st.textContent='searching...';out.innerHTML='';
var lg=document.getElementById('legend');lg.style.display='none';
fetch('/query',{method:'POST',headers:h,body:JSON.stringify(body)}).then(function(r){
return r.json().then(function(j){return [r.status,j];});}).then(function(a){var j=a[1];
if(a[0]!==200){st.textContent='error '+a[0]+': '+j.detail;return;}
st.textContent=j.hits.length+' results, method '+j.method+', '+j.num_tokens+' target tokens, '
+(j.seconds.total*1000).toFixed(0)+' ms';
j.hits.forEach(function(hit,i){var d=document.createElement('div'),hd=document.createElement('h3');
hd.textContent='#'+(i+1)+'  id '+hit.id+'  score '+gxNum(hit.score);d.appendChild(hd);
if(hit.explanation){lg.style.display='';d.appendChild(gxHeat(hit.explanation.tokens,hit.explanation.scores));
var q=document.createElement('details'),s=document.createElement('summary');s.textContent='query tokens';
q.appendChild(s);q.appendChild(gxHeat(hit.explanation.query_tokens,hit.explanation.query_scores));d.appendChild(q);}
else{var pre=document.createElement('div');pre.className='heat';pre.textContent=hit.text||'(text unavailable)';
if(hit.truncated){pre.textContent+=' … (the first '+hit.text.length+' of '+hit.text_chars+' characters; '
+'the whole text: GET /example/'+hit.id+')';}
d.appendChild(pre);}out.appendChild(d);});}).catch(function(e){st.textContent='request failed: '+e;});}
document.getElementById('f').addEventListener('submit',function(ev){ev.preventDefault();gxRun();});
(function(){var u=new URLSearchParams(window.location.search);['text','prompt','completion','k','method']
.forEach(function(n){if(u.get(n)!==null){document.getElementById(n).value=u.get(n);}});
if(u.get('text')||u.get('completion')){gxRun();}})();
"""

_PAGE = page("gradindex", _BODY, _SCRIPT)


def serve(engine: QueryEngine, host: str = "127.0.0.1", port: int = 8000, token: str | None = None,
          request_timeout: float = 30.0, queue_size: int = 64, max_batch: int = 16,
          batch_window: float = 0.002) -> None:
    """Run the server until interrupted."""
    import uvicorn

    app = create_app(engine, token, request_timeout, queue_size, max_batch, batch_window)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        app.state.batcher.stop()
