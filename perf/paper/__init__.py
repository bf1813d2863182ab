"""The paper's experiments (§8) reproduced on this machine (`experiments`), their PNG plots
(`plots`), and operator diversity measured stage by stage (`operator_diversity`)."""
