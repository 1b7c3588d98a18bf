"""Adapters from other environment libraries to grouprl's environment protocol (rollout/multiturn.py).

Each adapter is its own module and imports its library itself, so `import grouprl.envs` needs none of
them: `grouprl.envs.openenv` (OpenEnv, `pip install 'grouprl[openenv]'`).
"""
