"""kvservice as an SGLang disaggregation transfer backend (docs/sglang.md).

``--disaggregation-transfer-backend kvservice`` once the plugin's entry point is installed
(``plugin``); ``conn`` holds the classes SGLang instantiates (importing it imports SGLang),
``memory`` maps SGLang's ``KVArgs`` onto ``kvservice.memory``, ``checks`` checks every value
SGLang hands over, and ``bootstrap`` is the registry a decode finds the prefill ranks in.
"""
