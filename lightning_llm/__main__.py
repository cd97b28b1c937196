from lightning_llm.cli import main

main()
