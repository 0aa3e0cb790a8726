"""The vocabulary every layer shares: requests, sampling parameters, scheduler and engine outputs.

Plain data with no logic that imports a higher folder; every other folder of ``fastdeploy`` may
import it, and it imports nothing of the engine but :mod:`fastdeploy.config`.
"""
