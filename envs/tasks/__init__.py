"""The concrete envs, each a `ToolEnv`: Zorplex (zorplex.py), SumDigits (sum_digits.py), Shop
(shop.py), PyCalc (pycalc.py) and CodeTests (code_tests.py; both need the code sandbox),
registered as `toolgym/<Name>-v0` (envs/registry.py) and re-exported by toolgym.envs.
"""
