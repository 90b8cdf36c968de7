from setuptools import find_packages, setup

setup(
    name="llm-serving",
    version="0.1.0",
    description="Continuous-batching LLaMA serving over a paged KV cache, with MindSpore agents",
    packages=find_packages(include=["llm_serving", "llm_serving.*"]),
    package_data={"llm_serving": ["configs/*.yaml", "models/kernels/*.cc"]},
    python_requires=">=3.9",
    install_requires=[
        "numpy<2",
        "mindspore==2.10.0",
        "sentencepiece",
        "safetensors",
        "pyyaml",
        "aiohttp",
        "psutil",
        "prometheus_client",
        "jinja2",
    ],
    extras_require={
        "bench": ["matplotlib", "tqdm"],
        "test": ["pytest", "pytest-timeout", "hypothesis", "matplotlib", "tqdm", "openai"],
        "ascend": ["mindformers"],
    },
    entry_points={"console_scripts": ["llm-serving=llm_serving.cli:main"]},
)
