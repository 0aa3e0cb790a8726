"""Installs the ``fastdeploy`` package, the project's kernels (``custom_ops``) and the CLI."""

from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
requirements = [
    line.strip()
    for line in (here / "requirements.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")
]

setup(
    name="fastdeploy-torch",
    version="0.1.0",
    description="FastDeploy-style LLM serving engine on PyTorch with piecewise CUDA graphs",
    long_description=(here / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["fastdeploy", "fastdeploy.*", "custom_ops", "custom_ops.*"]),
    # the shipped chat template for tool calling (docs/tool-calling.md)
    package_data={"fastdeploy.entrypoints.openai": ["*.jinja"]},
    install_requires=requirements,
    extras_require={
        # accelerate: transformers needs it to load the GGUF reference model in the tests.
        "test": [
            "pytest>=8",
            "openai>=1.30",
            "httpx>=0.27",
            "accelerate>=0.30",
            "ruff>=0.5",
            "hypothesis>=6",
            # validates structured outputs against their schema (tests/entrypoints)
            "jsonschema>=4",
        ],
        "gpu": ["flashinfer-python>=0.5"],
    },
    entry_points={"console_scripts": ["fastdeploy=fastdeploy.entrypoints.cli.main:main"]},
)
