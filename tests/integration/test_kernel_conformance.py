"""The Jupyter project's own kernel test suite, against the tandem kernel through the gateway."""

from __future__ import annotations

import unittest

import jupyter_kernel_test
import pytest


@pytest.mark.integration
@pytest.mark.usefixtures("tandem_cluster")
class TandemKernelTests(jupyter_kernel_test.KernelTests):
    kernel_name = "tandem"
    language_name = "python"
    file_extension = ".py"

    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"
    completion_samples = [{"text": "zi", "matches": {"zip"}}]
    complete_code_samples = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n"]
    incomplete_code_samples = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples = ["import = 7q"]
    code_page_something = "zip?"
    code_generate_error = "raise"
    code_execute_result = [
        {"code": "1+2+3", "result": "6"},
        {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"},
    ]
    code_display_data = [
        {
            "code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))",
            "mime": "text/html",
        },
        {
            "code": "from IPython.display import Math, display; display(Math('\\\\frac{1}{2}'))",
            "mime": "text/latex",
        },
    ]
    code_history_pattern = "1?2*"
    # "range": a stock ipykernel fails it too (IPython numbers the current session 0 in a range
    # reply, where the test expects the number its tail reply gave)
    supported_history_operations = ("tail", "search")
    code_inspect_sample = "zip"
    code_clear_output = "from IPython.display import clear_output; clear_output()"


if __name__ == "__main__":
    unittest.main()
