"""The server process's side of the process line: what an API server (or a test) uses to drive
an engine that runs elsewhere, in a process of its own or on a thread.

* :mod:`.async_engine`: :class:`~.async_engine.AsyncLLMEngine`, the asynchronous front the HTTP
  handlers call (admission, request streams, metrics, the engine's death and stalls);
* :mod:`.request_stream`: one request's queued outputs and the stream its consumer reads;
* :mod:`.output_processor`: engine outputs into cumulative ``RequestOutput`` objects (also used
  by the offline ``LLM``);
* :mod:`.stall_watch`: whether the engine loop is stuck (``--engine-stall-timeout``);
* :mod:`.process_client`: starts the engine process and talks to it over two pipes;
* :mod:`.pipe_frames`: whole messages from the non-blocking pipe the event loop reads;
* :mod:`.thread_core`: the engine loop on a thread of this process.

It talks to the engine only in the typed messages of :mod:`fastdeploy.core.messages`, and
imports from below only ``fastdeploy.core``, ``fastdeploy.config``, ``fastdeploy.envs``,
``fastdeploy.platforms`` and (for now) ``fastdeploy.metrics``. The exceptions are the two
launchers of the engine, listed in :data:`ENGINE_IMPORTERS`: they may import the engine's entry
points (``EngineLoop``; the engine process's main).
"""

#: The modules of this package that may import ``fastdeploy.engine`` (the launchers).
ENGINE_IMPORTERS = (
    "fastdeploy.entrypoints.engine_client.process_client",
    "fastdeploy.entrypoints.engine_client.thread_core",
)
