from gradindex.cli import main

main()
