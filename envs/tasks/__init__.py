"""The concrete envs, each a `ToolEnv`: Zorplex (zorplex.py), SumDigits (sum_digits.py), Shop
(shop.py) and PyCalc (pycalc.py, the code sandbox's task), registered as `toolgym/<Name>-v0`
(envs/registry.py) and re-exported by toolgym.envs.
"""
