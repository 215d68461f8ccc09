"""TRL-layout training scripts, one module per verb: ``python -m posttrain.scripts.<verb> [options]``.

Each module has ``make_parser(prog)`` and ``main(script_args, training_args, model_args, dataset_args=None)``;
``posttrain <verb>`` parses with the same parser and runs ``main`` here or in launched worker processes.
"""
