"""Units and the JSON schema tag shared by the simulate modules."""

SCHEMA = "matrix_owner_optim.simulate/1"
GB = 1e9
