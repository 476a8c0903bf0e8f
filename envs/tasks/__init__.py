"""The concrete envs, each a `ToolEnv`: Zorplex (zorplex.py), SumDigits (sum_digits.py) and Shop
(shop.py), registered as `toolgym/<Name>-v0` (envs/registry.py) and re-exported by toolgym.envs.
"""
