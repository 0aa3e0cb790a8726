"""A worker behind NVIDIA Dynamo (``ai-dynamo`` 1.6): Dynamo's OpenAI frontend tokenizes, applies
the chat template and routes; this worker generates tokens with our engine.

Start it with ``python -m fastdeploy.integrations.dynamo [engine flags]`` (the flags of
``fastdeploy serve``, plus the Dynamo group: :mod:`.args`). The pieces:

* :mod:`.args`: the command line (``fastdeploy serve``'s engine flags and Dynamo's);
  :mod:`.launch`: start-up that names the package to install when Dynamo is missing.
* :mod:`.model_card`: the HF-style directory (``config.json`` and tokenizer files) Dynamo's
  frontend reads; for a GGUF model it is written from the GGUF's config and tokenizer.
* :mod:`.request_map`: Dynamo's token-in request to our ``SamplingParams`` and our outputs to
  Dynamo's token-out chunks (finish reasons, usage, logprobs).
* :mod:`.engine`: :class:`~.engine.FastDeployEngine`, an implementation of Dynamo's documented
  Python backend contract (``dynamo.common.backend.LLMEngine``, Dynamo 1.6
  ``components/src/dynamo/common/backend/README.md``): Dynamo's Rust ``Worker`` owns the runtime
  (etcd discovery, TCP request plane, NATS or ZMQ event plane), model registration,
  cancellation monitoring and the SIGTERM sequence (unregister, grace period, our clean-up); we
  own start-up, generation, abort, the drain and clean-up, the load snapshots, and name our
  KV-event ZMQ socket, which the ``Worker`` relays to the KV router.

Nothing here is imported by the engine or the HTTP server; ``dynamo`` is imported only when the
worker starts.
"""
