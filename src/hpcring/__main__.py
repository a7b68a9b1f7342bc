from hpcring.cli.main import main

main()
