# Type stubs for fastattn.cli.bench: `fastattn bench`, its public names re-exported.
from .ceilings import measure_ceilings as measure_ceilings
from .command import add_arguments as add_arguments, run as run
from .contenders import (CONTENDERS as CONTENDERS, Unavailable as Unavailable,
                         make_callable as make_callable, make_inputs as make_inputs,
                         torch_implementation as torch_implementation)
from .grid import GRID as GRID, QUICK_GRID as QUICK_GRID, Case as Case
from .overhead import measure_overhead as measure_overhead
from .report import (format_report as format_report, format_serving as format_serving,
                     plot_report as plot_report, write_json as write_json)
from .runner import (benchmark_report as benchmark_report,
                     geometric_means as geometric_means, run_benchmarks as run_benchmarks)
from .scaling import run_scaling as run_scaling, scaling_report as scaling_report
from .serving import (QUICK_SERVING_GRID as QUICK_SERVING_GRID,
                      SERVING_GRID as SERVING_GRID, ServingCase as ServingCase,
                      run_serving as run_serving)
from .threads import default_threads as default_threads, thread_limits as thread_limits
from .torch_op import (TORCH_OP_CASE as TORCH_OP_CASE,
                       measure_torch_op as measure_torch_op)

__all__ = ["Case", "GRID", "QUICK_GRID", "CONTENDERS", "Unavailable", "add_arguments",
           "run", "run_benchmarks", "benchmark_report", "geometric_means",
           "measure_ceilings", "thread_limits", "make_inputs", "make_callable",
           "format_report", "write_json", "plot_report", "default_threads",
           "measure_overhead", "run_scaling", "scaling_report", "torch_implementation",
           "measure_torch_op", "TORCH_OP_CASE", "ServingCase", "SERVING_GRID",
           "QUICK_SERVING_GRID", "run_serving", "format_serving"]
