from tests.trainer.conftest import digits_data, make_cfg, tiny_model_dir  # noqa: F401  (fixtures)
