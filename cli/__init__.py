"""The top floor: the `pdserve` command (`main`), `make demo` (`demo`) and `pdserve top`/`status`
(`top`). Everything else sits below and never imports these."""
