"""The command-line application's parts beside its entry point `dsv41_convert.cli`: shared option
aliases (`options`), what the terminal shows (`report`: tables, progress bars, JSON) and the built-in
demo pipeline (`demo`). The only code that writes to the terminal; may import every other subpackage.
"""
