"""Adapters that put the engine behind another serving layer (a fleet's frontend and router).

Each one is a launcher, like :mod:`fastdeploy.entrypoints`: it builds the engine exactly as
``fastdeploy serve`` does and speaks the other layer's protocol instead of HTTP.

* :mod:`fastdeploy.integrations.dynamo`: a worker behind NVIDIA Dynamo's frontend and KV router.
"""
